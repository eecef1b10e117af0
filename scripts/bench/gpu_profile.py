"""What the GPU did inside named host ranges of a torch profiler run: busy time and largest kernels.

    with torch.profiler.profile(activities=...) as prof:
        with torch.profiler.record_function(NAME): ...     # once per thing measured
    windows = range_activity(prof, NAME)                    # per range: host interval and GPU activities
    covered_ns(intervals), top_kernels([w.activity ...])

Raw kineto events are read (the profiler's event tree is not built: slow for thousands of steps). A GPU
activity belongs to the range its start falls in: the ranges end with a device-to-host transfer, so their
work has run by then.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass, field

from scripts.bench_steps import event_kind

GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_RANGES = ("user_annotation", "host")


@dataclass
class RangeActivity:
    start_ns: int  # the host range
    stop_ns: int
    activity: list[tuple[int, int, str]] = field(default_factory=list)  # (start ns, stop ns, name) on the GPU

    @property
    def busy_ns(self) -> int:
        return covered_ns([a[:2] for a in self.activity])

    @property
    def first_launch_ns(self) -> int | None:
        """From the range's start to the GPU's first activity in it (host time before the GPU has work)."""
        return min(a[0] for a in self.activity) - self.start_ns if self.activity else None


def range_activity(prof, name: str) -> list[RangeActivity]:
    """The host ranges named `name`, in order, each with the GPU activities that start inside it."""
    events = list(prof.profiler.kineto_results.events())
    windows = [RangeActivity(e.start_ns(), e.start_ns() + e.duration_ns())
               for e in sorted((e for e in events if e.name() == name and event_kind(e) in HOST_RANGES),
                               key=lambda e: e.start_ns())]
    starts = [w.start_ns for w in windows]
    for e in events:
        # a range is mirrored on the GPU's timeline, and this torch reports the mirror as a device event
        if event_kind(e) in GPU_ACTIVITIES and e.name() != name:
            i = bisect.bisect_right(starts, e.start_ns()) - 1
            if i >= 0 and e.start_ns() < windows[i].stop_ns:
                windows[i].activity.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    return windows


def kernel_group(name: str) -> str:
    """A kernel's name without its template arguments and signature (the instances of one kernel summed)."""
    return re.split(r"[<(]", name.removeprefix("void "), maxsplit=1)[0][:80] or name[:80]


class Tally:
    """Durations summed by name, with counts and the longest one (kernels by name, the host's CUDA calls)."""

    def __init__(self):
        self.ns, self.calls, self.longest = defaultdict(int), defaultdict(int), defaultdict(int)

    def add(self, name: str, ns: int) -> None:
        self.ns[name] += ns
        self.calls[name] += 1
        self.longest[name] = max(self.longest[name], ns)

    def total(self) -> int:
        return sum(self.ns.values())

    def ranked(self, top: int) -> list[str]:
        """The `top` names that took most time, most first."""
        return sorted(self.ns, key=self.ns.get, reverse=True)[:top]

    def lines(self, steps: int, top: int, longest: bool = False) -> list[str]:
        """Report lines of the `top` names: us and calls per step over `steps` (and the longest call)."""
        return [f"  {self.ns[name] / steps / 1e3:8.1f} us  x{self.calls[name] / steps:5.1f}"
                + (f"  longest {self.longest[name] / 1e3:8.1f} us" if longest else "") + f"  {name}"
                for name in self.ranked(top)]


def top_kernels(steps: list[list[tuple[int, int, str]]], top: int = 12) -> list[tuple[str, float, float]]:
    """The kernel groups that took most GPU time over `steps`: (name, us per step, launches per step)."""
    tally = Tally()
    for step in steps:
        for start, stop, name in step:
            tally.add(kernel_group(name), stop - start)
    return [(name, tally.ns[name] / len(steps) / 1e3, tally.calls[name] / len(steps)) for name in tally.ranked(top)]


def covered_ns(intervals: list[tuple[int, int]]) -> int:
    """The time the GPU was busy: the union of its activities' intervals (a graph's kernels can be reported
    more than once, and copies overlap kernels)."""
    total, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total

"""How long the host waits for the GPU: the time spent in CUDA event waits (a step's read of its tokens, the guards of
pinned buffers), while counting. A step whose host never waits was host-bound: the GPU ran out of queued work before
the host queued more. On shared machines whole stretches of steps turn host-bound (every host function slower, the
same calls made), which this tells apart from a step that does more GPU work.

    waits = HostWaits()
    with waits:
        ...                      # waits.seconds grows by every event wait in here

With `sites=True` it also says where: the seconds waited at each call site (the innermost frames of the project's
code), and, on CUDA, the torch calls that made the host wait by themselves (a tensor's `.item()`, a copy to pageable
memory: CUDA's sync debug mode), counted at their sites. A step that should overlap the GPU's work but waits for it
shows where; `take_sites` hands over what was counted since it was last called (one step's, say).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

from scripts.bench.host_profile import is_projects

SITE_FRAMES = 3  # the project's innermost frames that name a site: the call that waited and two of its callers
SYNC_WARNING = "called a synchronizing CUDA operation"  # CUDA's sync debug mode, as torch words it


class HostWaits:
    def __init__(self, sites: bool = False):
        self.seconds = 0.0
        self.sites = sites
        self.waited_at: Counter[str] = Counter()  # site -> seconds waited in event waits there (with sites)
        self.waits_at: Counter[str] = Counter()  # site -> event waits there
        self.synced_at: Counter[str] = Counter()  # site -> torch calls there that waited by themselves (on CUDA)
        self._synchronize = None
        self._warnings = None
        self._sync_mode = 0

    def __enter__(self) -> "HostWaits":
        synchronize = self._synchronize = torch.cuda.Event.synchronize

        def counted(event) -> None:
            start = time.perf_counter()
            synchronize(event)
            waited = time.perf_counter() - start
            self.seconds += waited
            if self.sites:
                site = call_site()
                self.waited_at[site] += waited
                self.waits_at[site] += 1

        torch.cuda.Event.synchronize = counted
        if self.sites and torch.cuda.is_available():
            self._count_synchronizing_calls()
        return self

    def _count_synchronizing_calls(self) -> None:
        """CUDA's sync debug mode on, its warnings counted by site (`synced_at`), not shown; `__exit__` undoes it."""
        self._warnings = warnings.catch_warnings()  # restores the filters and `showwarning` on leaving
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=SYNC_WARNING)
        show = warnings.showwarning

        def shown(message, *args, **kwargs) -> None:
            if SYNC_WARNING in str(message):
                self.synced_at[call_site()] += 1
            else:
                show(message, *args, **kwargs)

        warnings.showwarning = shown
        self._sync_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")

    def __exit__(self, *exc) -> None:
        torch.cuda.Event.synchronize = self._synchronize
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode(self._sync_mode)  # as it was
            self._warnings.__exit__(*exc)
            self._warnings = None

    def take_sites(self) -> tuple[Counter, Counter, Counter]:
        """(seconds waited, event waits, synchronizing calls) by site since the last call, and counting starts anew."""
        taken = self.waited_at, self.waits_at, self.synced_at
        self.waited_at, self.waits_at, self.synced_at = Counter(), Counter(), Counter()
        return taken


def call_site(frames: int = SITE_FRAMES) -> str:
    """A wait's site: the innermost `frames` frames of the project's code on the stack, innermost first (this module's
    frames left out, as are those outside the project, such as the warnings machinery's)."""
    names, frame = [], sys._getframe(1)
    while frame is not None and len(names) < frames:
        file = frame.f_code.co_filename
        if is_projects(file, exclude=__file__):
            names.append(f"{Path(file).name}:{frame.f_lineno}({frame.f_code.co_name})")
        frame = frame.f_back
    return " < ".join(names) or "(outside the project)"

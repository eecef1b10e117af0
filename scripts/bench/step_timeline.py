"""The host's path from a speculative step's tokens reaching it to the next verify's launch, per step.

    with StepTimeline(llm) as timeline:
        llm.generate(prompts, params)
    print(timeline.report())

With the next draft queued ahead, the GPU has only that draft to run (~0.43 ms for the shipped drafter on an
H200) between a step's tokens being read and the next verify being launched: whatever the host does on that
path beyond the draft's time leaves the GPU idle, and at batch 1 it decides the step's wall time. Host
timestamps (no GPU timing) around the pieces on that path: the read, the speculative step, the engine step,
the target's `run_block` and its attention plan; medians over the steps, in ms.
"""

from __future__ import annotations

import statistics
import time

from specdec.engine import decoding

# (label, from mark, to mark): a mark is a piece's name and ">" (entered) or "<" (left)
SEGMENTS = (
    ("tokens read -> step done (commit, rollback, policy)", "read<", "step<"),
    ("step done -> next step (engine: retire, schedule)", "step<", "step>"),
    ("next step -> verify planning (policy, draft, pages, inputs)", "step>", "plan>"),
    ("verify plan", "plan>", "plan<"),
    ("tokens read -> verify planned", "read<", "plan<"),
)


class StepTimeline:
    def __init__(self, llm):
        self.engine = llm.engine
        self.marks: list[tuple[str, float]] = []
        self._restore: list[tuple[object, str, object]] = []
        self._in_block = False

    def __enter__(self) -> "StepTimeline":
        spec, runner = self.engine.decoding, self.engine.runner
        self._wrap(decoding.StepTransfer, "read", "read")
        self._wrap(spec, "step", "step")
        self._wrap(runner, "run_block", "block")
        for method in ("plan_graph", "plan"):  # the verify's plan: the one made inside run_block
            if hasattr(runner.attn, method):  # (a backend without graphs has no plan_graph)
                self._wrap(runner.attn, method, "plan", inside_block=True)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._restore):
            if isinstance(owner, type):
                setattr(owner, name, original)
            else:
                delattr(owner, name)  # the instance's own attribute goes: the class's method shows again
        self._restore.clear()

    def _wrap(self, owner, name: str, piece: str, inside_block: bool = False) -> None:
        original = getattr(owner, name)
        self._restore.append((owner, name, original))
        marks, timeline = self.marks, self

        def timed(*args, **kwargs):
            counted = not inside_block or timeline._in_block
            if piece == "block":
                timeline._in_block = True
            if counted:
                marks.append((piece + ">", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                if piece == "block":
                    timeline._in_block = False
                if counted:
                    marks.append((piece + "<", time.perf_counter()))

        setattr(owner, name, timed)

    def segments(self) -> dict[str, list[float]]:
        """Seconds of each segment, one value per step whose tokens were read and whose next verify was planned."""
        found: dict[str, list[float]] = {label: [] for label, _, _ in SEGMENTS}
        found["waiting for the tokens"], found["step (wall)"] = [], []
        step: dict[str, float] = {}
        entered: dict[str, float] = {}
        last_step_start = None
        for mark, at in self.marks:
            if mark.endswith(">"):
                entered[mark[:-1]] = at
            elif mark == "read<" and "read" in entered:
                found["waiting for the tokens"].append(at - entered["read"])
            if mark == "step>":
                if last_step_start is not None:
                    found["step (wall)"].append(at - last_step_start)
                last_step_start = at
            if mark == "read<":
                step = {"read<": at}
            elif step and mark not in step:
                step[mark] = at
                if mark == "plan<":
                    for label, start, end in SEGMENTS:
                        if start in step and end in step:
                            found[label].append(step[end] - step[start])
                    step = {}
        return found

    def report(self) -> str:
        rows = [f"{statistics.median(values) * 1e3:8.3f} ms  {label} (median of {len(values)})"
                for label, values in self.segments().items() if values]
        return "\n".join(["host path from a step's tokens to the next verify's launch:", *rows])

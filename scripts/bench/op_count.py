"""The tensor operations the host dispatches per decode step, by kind of operation.

    with OpCount(llm) as ops:
        results = llm.generate(prompts, params)
    print(ops.report())

Every dispatched aten operation except views and metadata (each a kernel on a GPU) is counted while the engine's
decoding runs a step (`decoding.step`: a speculative step, or a plain step run in order; an overlapped plain decoding
engine launches its steps otherwise, and nothing is counted there). On the CPU that is all of a step's work; on the
GPU what CUDA graphs replay is not dispatched, so the count is what the host launches outside them. Counting
compares steps' work where timing cannot: a token-tree step against a chain step on the development CPU, say.
"""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

# operations that make no kernel: views, metadata, allocation without a fill
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "slice", "select", "expand", "as_strided", "unsqueeze", "squeeze", "t", "permute",
    "transpose", "alias", "detach", "reshape", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind",
    "narrow", "lift_fresh", "_reshape_alias", "view_as", "diagonal", "unfold", "expand_as", "_local_scalar_dense",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor", "sym_size", "dim",
})


class _Counter(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class OpCount:
    """Counts the operations of the decoding's `step` calls of `llm`'s engine (its decode steps)."""

    def __init__(self, llm):
        self.decoding = llm.engine.decoding
        self.counts: collections.Counter = collections.Counter()
        self.steps = 0

    def __enter__(self) -> OpCount:
        step = self._step = self.decoding.step

        def counted(*args, **kwargs):
            self.steps += 1
            with _Counter(self.counts):
                return step(*args, **kwargs)

        self.decoding.step = counted
        return self

    def __exit__(self, *exc) -> None:
        self.decoding.step = self._step

    def report(self, top: int = 12) -> str:
        steps = max(self.steps, 1)
        lines = [f"{sum(self.counts.values()) / steps:.0f} operations dispatched per step ({self.steps} steps); most "
                 "frequent, per step:"]
        lines += [f"  {name:<24} {count / steps:6.1f}" for name, count in self.counts.most_common(top)]
        return "\n".join(lines)

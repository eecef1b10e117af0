"""A planned FlashInfer paged wrapper's kernel call, with its arguments kept for the plan's later layers.

A step with prompt chunks attends eagerly between its piecewise CUDA graphs, one wrapper `run` per layer (28 a step
on the default target), and each `run` derives and checks the same ~50 kernel arguments from the wrapper's plan
before it calls the kernel. That is host time on the path of such a step, and DFlash's steps with a prompt are
bound by the host (BENCHMARKS.md). So the first layer after a plan runs through the wrapper's own `run` while the
one kernel call it makes is watched (`PlannedRun.record`), and every later layer of that plan calls the same kernel
with the same arguments, its own query, K/V cache and output put in their places.

Only where the watched call shows unambiguously where those four go (one call, positional arguments, each of
them exactly once, the output returned as given) is the call kept; otherwise, and for a query of another shape,
every layer goes through `run` as before. A plan's arguments are valid until the wrapper's next plan: the backend
drops its kept calls at every plan.
"""

from __future__ import annotations

import torch


class _WatchedModule:
    """Stands in for a wrapper's compiled module while one `run` goes through it: records its `paged_run` calls."""

    def __init__(self, module, calls: list):
        self._module, self._calls = module, calls

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def paged_run(self, *args, **kwargs):
        self._calls.append((args, kwargs))
        return self._module.paged_run(*args, **kwargs)


def _places(args: tuple, match) -> list[int]:
    return [i for i, arg in enumerate(args) if match(arg)]


def _same_view(a, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


class PlannedRun:
    """`run(q, kv, out)` of one planned wrapper, as the kernel call its first run made (see the module's doc)."""

    def __init__(self, wrapper, kernel, args: tuple, q: torch.Tensor, places: tuple[int, int, int, int]):
        self.wrapper = wrapper
        self.kernel = kernel
        self.args = list(args)
        self.q_shape, self.q_dtype = q.shape, q.dtype
        self.q_at, self.k_at, self.v_at, self.out_at = places

    @classmethod
    def record(cls, wrapper, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor
               ) -> tuple[torch.Tensor, PlannedRun | None]:
        """Run `wrapper.run(q, kv, out=out)` (kv: one layer's cache, [pages, 2, ...], K and V on dim 1) and return
        its output with the call to keep for the plan's later layers (None: keep calling `run`)."""
        module = getattr(wrapper, "_cached_module", None)
        if module is None or not callable(getattr(module, "paged_run", None)):
            return wrapper.run(q, kv, out=out), None
        calls: list = []
        wrapper._cached_module = _WatchedModule(module, calls)
        try:
            result = wrapper.run(q, kv, out=out)
        finally:
            wrapper._cached_module = module
        return result, cls._kept(wrapper, module.paged_run, calls, q, kv, out, result)

    @classmethod
    def _kept(cls, wrapper, kernel, calls: list, q, kv, out, result) -> PlannedRun | None:
        if len(calls) != 1 or result is not out:
            return None
        args, kwargs = calls[0]
        if kwargs:
            return None
        k, v = kv.unbind(1)
        found = [_places(args, lambda a: a is q), _places(args, lambda a: _same_view(a, k)),
                 _places(args, lambda a: _same_view(a, v)), _places(args, lambda a: a is out)]
        if any(len(at) != 1 for at in found):
            return None
        return cls(wrapper, kernel, args, q, tuple(at[0] for at in found))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if q.shape != self.q_shape or q.dtype != self.q_dtype or out.shape != q.shape:
            return self.wrapper.run(q, kv, out=out)
        args = self.args
        args[self.q_at], args[self.out_at] = q, out
        args[self.k_at], args[self.v_at] = kv.unbind(1)
        self.kernel(*args)
        return out

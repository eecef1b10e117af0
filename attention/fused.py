"""Small tensor functions compiled into a few fused GPU kernels, for steps replayed from CUDA graphs.

A lone request's token-tree step does its building, acceptance and node-row bookkeeping in ~200 small kernels
(gathers, scatters, comparisons, cumulative sums over 16 nodes). In a CUDA graph each still costs its launch, ~2-3 us
on an H100, ~0.4 ms a step where the whole chain step takes ~3 ms. torch.compile (inductor) fuses such a function
into a few Triton kernels; the same functions give the same values either way (integer and boolean work, and the
same float sums), and the CPU always runs them as they are written.

    build = fused_if(build_trees, fusing(device))

A compiled function is specialized to the shapes and Python values it is called with: a new shape compiles again
(seconds). So only the bodies of a lone request's CUDA graphs use it: a few fixed shapes, compiled at start-up in
the warm-up call before each graph's capture; steps without graphs run the functions as written.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

# 1 compiles these functions on the GPU (start-up: their compile, ~12 s on a fresh machine, ~4 s once inductor's
# cache holds them); 0 runs them as written. Off by default: they speed up tree steps only (~4% of a lone request's
# TPOT on math500, BENCHMARKS), and `auto` ran chains for a lone request on that run
ENV_SWITCH = "SPECDEC_FUSED_KERNELS"
DEFAULT = "0"


def fusing(device: torch.device | str) -> bool:
    """Whether `fused` functions compile on this device: CUDA with Triton importable, where switched on."""
    return (torch.device(device).type == "cuda" and os.environ.get(ENV_SWITCH, DEFAULT) != "0"
            and importlib.util.find_spec("triton") is not None)


@functools.lru_cache(maxsize=None)
def fused(fn: F, backend: str = "inductor") -> F:
    """`fn` compiled whole (no graph breaks: a break would split the kernels again) for the shapes it is called with;
    one compiled function per `fn`, so every engine of a process shares its compiled code. Where compiling fails
    (a compiler that cannot handle this GPU or these shapes), it warns once and runs `fn` as written."""
    return Fused(fn, torch.compile(fn, fullgraph=True, backend=backend))


def fused_if(fn: F, fuse: bool) -> F:
    """`fn` compiled where `fuse` (a caller's `fusing` of its device), else `fn` as written."""
    return fused(fn) if fuse else fn


class Fused:
    """A function and its compiled form: calls go to the compiled one until it fails to compile, then to the
    function."""

    def __init__(self, fn: Callable, compiled: Callable):
        self.fn, self.compiled = fn, compiled
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as error:
                if not isinstance(error, compile_errors()):
                    raise
                # raised while compiling, before any kernel ran: the call below starts from the same state
                self.failed = True
                warnings.warn(f"{self.fn.__qualname__} runs unfused: torch.compile failed ({error!r:.300})",
                              stacklevel=2)
        return self.fn(*args, **kwargs)


def compile_errors() -> tuple[type[Exception], ...]:
    """What torch.compile raises where it cannot compile a function (imported here: the compiler's modules take ~1 s
    to import, and only GPU engines use it)."""
    import torch._dynamo.exc
    import torch._inductor.exc
    return tuple(error for error in (getattr(torch._dynamo.exc, "TorchDynamoException", None),
                                     getattr(torch._inductor.exc, "InductorError", None)) if error is not None)

"""Paged KV memory and attention kernels; imports nothing else of the project.

Attention backends are registered by name and imported only when chosen, so a CPU install never
imports flashinfer:

    name = resolve_backend_name("auto", device)      # flashinfer on CUDA when importable, else torch
    backend = make_backend(name, num_qo_heads=..., num_kv_heads=..., head_dim=..., sm_scale=...,
                           device=device, kv_dtypes=(kv_dtype,), q_dtype=dtype)

A new backend subclasses `attention.backend.AttentionBackend` and calls `register_backend`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class BackendEntry:
    module: str  # imported on first use
    class_name: str
    needs_cuda: bool
    available: Callable[[], bool]  # importable here (checked only when the backend is asked for)
    install_hint: str


def _importable(module: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            importlib.import_module(module)
        except ImportError:
            return False
        return True

    return check


_REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, module: str, class_name: str, *, needs_cuda: bool = False,
                     available: Callable[[], bool] = lambda: True, install_hint: str = "") -> None:
    _REGISTRY[name] = BackendEntry(module, class_name, needs_cuda, available, install_hint)


register_backend("torch", "attention.torch_backend", "TorchBackend")
register_backend("flashinfer", "attention.flashinfer_backend", "FlashInferBackend", needs_cuda=True,
                 available=_importable("flashinfer"), install_hint="install it with `pip install 'specdec[gpu]'`")

# 'auto' picks the first of these that can run on the device
AUTO_ORDER = ("flashinfer", "torch")


def _usable(entry: BackendEntry, device: torch.device) -> bool:
    return (device.type == "cuda" or not entry.needs_cuda) and entry.available()


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' -> the first usable backend of AUTO_ORDER; an explicit name is checked against the device."""
    if name == "auto":
        return next(n for n in AUTO_ORDER if n in _REGISTRY and _usable(_REGISTRY[n], device))
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(_REGISTRY)}")
    if entry.needs_cuda and device.type != "cuda":
        raise ValueError(f"the {name} attention backend needs a CUDA device; use --attention-backend torch")
    if not entry.available():
        raise ImportError(f"the {name} attention backend was requested but is not importable; "
                          f"{entry.install_hint or 'install it'} or use --attention-backend torch")
    return name


def make_backend(name: str, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float,
                 device: torch.device, kv_dtypes: tuple[torch.dtype, ...], q_dtype: torch.dtype,
                 device_lengths: bool = False, window_left: int = -1):
    """Build the backend `name` (already resolved) for one model whose cache layers use `kv_dtypes`.
    device_lengths: its graph steps may be planned for upper bounds of the KV lengths, the real ones given on
    the device (`AttentionBackend.use_device_lengths`); window_left: a sliding window (`AttentionBackend`)."""
    entry = _REGISTRY[name]
    backend_class = getattr(importlib.import_module(entry.module), entry.class_name)
    return backend_class(num_qo_heads, num_kv_heads, head_dim, sm_scale, device=device, kv_dtypes=kv_dtypes,
                         q_dtype=q_dtype, device_lengths=device_lengths, window_left=window_left)

"""Copies between host and device that never make the host wait for more than the copy.

A copy from pageable memory, or one without non_blocking, stalls the host until the GPU has caught
up; inside a step that would serialize host planning with GPU work. Staging through pinned memory
from torch's caching host allocator keeps each copy asynchronous, and the allocator keeps the pinned
block alive until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned CPU tensor holding a copy of `array` (a plain CPU tensor when there is no CUDA)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.pin_memory() if torch.cuda.is_available() else tensor.clone()


def upload(array: np.ndarray, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)
    return pinned(array).to(device, non_blocking=True)


class HostCopy:
    """A device tensor's copy on its way to pinned host memory, queued when made: `tolist()` waits for that
    copy alone, not for the work queued after it (a step's forward keeps running while the host reads)."""

    def __init__(self, tensor: torch.Tensor):
        cuda = tensor.device.type == "cuda"
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        self._host.copy_(tensor, non_blocking=cuda)
        self._ready = torch.cuda.Event() if cuda else None
        if self._ready is not None:
            self._ready.record()

    def tolist(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

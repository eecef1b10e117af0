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


class CopyFence:
    """Guards pinned host buffers that queued copies read. A copy from pinned memory reads the host bytes when the
    stream reaches it, not when it is queued, so buffers written again before then change what an earlier step,
    still queued, receives. The window is normally microseconds (the copy follows the work the host last waited
    for), but on a GPU shared with other processes their work can run first for milliseconds. `mark` after queuing
    the copies; `wait` before writing the buffers again (normally the copies have long run, and it returns at once)."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._copied: torch.cuda.Event | None = None

    def mark(self) -> None:
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def busy(self) -> bool:
        """Whether a marked copy may still read the buffers (`wait` would block)."""
        if self._copied is not None and self._copied.query():
            self._copied = None
        return self._copied is not None


ALIGN = 64  # int32s: 256 bytes


class StagedIndices:
    """int32 arrays that kernels read on the device, as views of one device tensor, written on the host into a
    pinned tensor of the same layout and sent together: one copy for all of them (each copy from pinned memory
    costs the host ~15-20 us of CUDA calls). An array staged with fewer values than its size leaves the rest as
    it was; the last array is sent only as far as it was staged (put the long, partly used one last)."""

    def __init__(self, sizes: dict[str, int], device, ones: tuple[str, ...] = ()):
        self.offsets, total = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = (total, size)
            total += -(-size // ALIGN) * ALIGN  # each array starts as a separate allocation would
        self.device_tensor = torch.zeros(total, dtype=torch.int32, device=device)
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        for name in ones:
            self[name].fill_(1)
        self.end = 0  # how far the staged values reach

    def __getitem__(self, name: str) -> torch.Tensor:
        start, size = self.offsets[name]
        return self.device_tensor[start:start + size]

    def stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """`values` into the host copy of `name` (sent by `send`); returns that pinned slice."""
        start, size = self.offsets[name]
        if len(values) > size:
            raise ValueError(f"{len(values)} values do not fit the {size} of index buffer {name!r}")
        host = self.host[start:start + len(values)]
        host.numpy()[:] = values
        self.end = max(self.end, start + len(values))
        return host

    def send(self) -> None:
        """Queue one copy of everything staged since the last send (asynchronous from pinned memory)."""
        if self.end:
            self.device_tensor[:self.end].copy_(self.host[:self.end], non_blocking=True)
        self.end = 0

"""Zeroed tensors that take memory only where written, on the CPU.

`torch.zeros` on the CPU writes every byte, so a KV pool or a step's static buffers (the logits of every verify row:
0.6 GB for the default target) cost their zeroing at start-up and stay resident whole from the start. numpy's
`zeros` takes calloc's memory, the operating system's zero pages, which become resident only as they are written.
On other devices zeroing is a fast fill on the device, and `torch.zeros` is used as it is.
"""

from __future__ import annotations

import numpy as np
import torch

SMALL_BYTES = 1 << 20  # below this, zeroing costs nothing worth saving


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor; on the CPU made of the operating system's zero pages (numpy's calloc), which take memory only
    where first written: a pool of 2 GiB was 1 s of zeroing at start-up and all of it resident from the start."""
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if torch.device(device).type != "cpu" or size < SMALL_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(size, dtype=np.uint8)).view(dtype).view(shape)

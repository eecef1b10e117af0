"""Host-to-device copies that never make the host wait for the GPU.

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

"""Quantization-aware training: the drafter's Linear layers compute with the weights their storage will
hold, so a drafter shipped in a small storage (q4_0 fits twice the weights of fp8 in the same bytes)
loses nothing when it is stored.

Forward: each Linear weight goes through `fake_quantize` (quantize, dequantize: exactly what
`drafters.weight_storage` writes and `load_dflash` reads back). Backward: the straight-through
estimator (the rounding counts as the identity), so the float32 master weights keep learning below the
quantization step. The modules keep their class's parameters and names, so checkpoints, growth and
export are unchanged; exporting in the same storage gives exactly the weights trained with.

The GGML types follow gguf's own reference quantizers (`gguf.quants`), step for step in float32:
q8_0 (scale amax / 127, round half away from zero), q5_0 and q4_0 (scale = the block's largest-magnitude
value / -16 or / -8, codes trunc(x / d + 16.5 or 8.5) clamped); the scale is kept as float16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafters import weight_storage

BLOCK = 32  # weights per GGML block, along a row
SIGNED_MAX_BLOCK = {"q5_0": 16, "q4_0": 8}  # d = (the block's largest-magnitude weight) / -N
QUANT_AWARE_STORAGES = ("fp8", "q8_0", *SIGNED_MAX_BLOCK)


def check_storage(storage: str) -> None:
    if storage not in QUANT_AWARE_STORAGES:
        raise ValueError(f"quantization-aware training supports {', '.join(QUANT_AWARE_STORAGES)}, not {storage!r}")


def fake_quantize(w: torch.Tensor, storage: str) -> torch.Tensor:
    """float32 [out, in] -> the float32 weights `storage` stores for it (no gradient)."""
    check_storage(storage)
    w = w.detach().float()
    if storage == "fp8":
        q, scale = weight_storage.fp8_per_channel(w)
        return q.float() * scale[:, None]
    if w.shape[-1] % BLOCK:
        raise ValueError(f"rows of {w.shape[-1]} weights cannot be stored as {storage} (blocks of {BLOCK})")
    blocks = w.reshape(-1, BLOCK)
    if storage == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127
        scaled = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = scaled.sign() * (scaled.abs() + 0.5).floor()  # np_roundf: half away from zero
        out = q * d.half().float()
    else:
        n = SIGNED_MAX_BLOCK[storage]
        extreme = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        d = extreme / -n
        q = (blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d) + (n + 0.5)).trunc().clamp(0, 2 * n - 1)
        out = (q - n) * d.half().float()
    return out.reshape(w.shape)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, storage):
        return fake_quantize(w, storage).to(w.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class QuantAwareLinear(nn.Linear):
    """An nn.Linear whose forward uses its weight as `storage` holds it (set by `make_quant_aware`)."""
    storage: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _StraightThrough.apply(self.weight, self.storage), self.bias)


def make_quant_aware(model: nn.Module, storage: str) -> nn.Module:
    """Every nn.Linear of `model` (in place) computes with `storage`'s weights; returns the model."""
    check_storage(storage)
    for module in model.modules():
        if type(module) in (nn.Linear, QuantAwareLinear):
            module.__class__ = QuantAwareLinear
            module.storage = storage
    return model

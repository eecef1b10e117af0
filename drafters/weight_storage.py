"""Compact storage of a drafter's Linear weights in its safetensors file, dequantized at load.

A drafter directory names its storage in config.json (`"weight_storage"`); without the key, the weights
are plain (bf16), the z-lab format every reader knows. Norms and other 1-D weights stay bf16 in all of them.

    fp8                   float8 e4m3 `<name>` + float32 `<name>_scale`, one scale per output channel
                          (weight = e4m3 * scale[:, None]): ~1 byte per weight, relative error ~2.6%
    q8_0, q5_0, q5_1,     GGML block quantization (blocks of 32 along each row, a scale per block, and
    q4_1, q4_0            a minimum for the _1 types) by the `gguf` package: `<name>` is the uint8 rows
                          GGML lays out, [out, bytes per row]. Bytes per weight 1.06 / 0.69 / 0.75 /
                          0.63 / 0.56; on Gaussian weights relative error 0.5% / 4.3% / 3.8% / 7.8% / 8.6%

The smaller storages fit a larger drafter in the same bytes; what they cost in acceptance is measured
on held-out data (`train_drafter.py --eval-only` on the stored drafter).
"""

from __future__ import annotations

import numpy as np
import torch

STORAGE_KEY = "weight_storage"  # config.json key
FP8 = "fp8_e4m3_per_channel"
GGML_TYPES = ("q8_0", "q5_0", "q5_1", "q4_1", "q4_0")
STORAGES = ("bf16", "fp8", *GGML_TYPES)  # what export offers; bf16 is the plain format


def config_value(storage: str) -> str | None:
    """The config.json value that marks `storage` (None for plain bf16)."""
    if storage not in STORAGES:
        raise ValueError(f"unknown weight storage {storage!r}; choose one of {', '.join(STORAGES)}")
    return {"bf16": None, "fp8": FP8}.get(storage, f"ggml_{storage}")


def linear_bytes(weights: int, rows: int, storage: str) -> int:
    """Bytes `storage` takes for Linear weights: `weights` of them in `rows` output rows (a GGML block runs
    along one row, whose length `quantize` requires to be a multiple of the block)."""
    value = config_value(storage)
    if value is None:
        return 2 * weights
    if value == FP8:  # 1 byte per weight and a float32 scale per output row
        return weights + 4 * rows
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[_ggml_type(value)]
    return weights // block * size


def _ggml_type(value: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[value.removeprefix("ggml_").upper()]


def quantize(state: dict[str, torch.Tensor], linear: set[str], storage: str) -> dict[str, torch.Tensor]:
    """The tensors to save: the Linear weights named in `linear` in `storage`, everything else bf16."""
    value = config_value(storage)
    out = {}
    for name, w in state.items():
        w = w.detach().float().cpu()
        if name not in linear or value is None:
            out[name] = w.to(torch.bfloat16).contiguous()
        elif value == FP8:
            q, scale = fp8_per_channel(w)
            out[name] = q.contiguous()
            out[f"{name}_scale"] = scale.contiguous()
        else:
            out[name] = _ggml_quantize(name, w, value)
    return out


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [out, in] -> (float8 e4m3 weights, float32 scale per output row); weight = q * scale[:, None]."""
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale


def _ggml_quantize(name: str, w: torch.Tensor, value: str) -> torch.Tensor:
    from gguf import GGML_QUANT_SIZES, quants

    kind = _ggml_type(value)
    block = GGML_QUANT_SIZES[kind][0]
    if w.shape[-1] % block:
        raise ValueError(f"{name}: rows of {w.shape[-1]} weights cannot be stored as {value} (blocks of {block}); "
                         f"use --storage fp8 or bf16")
    return torch.from_numpy(np.ascontiguousarray(quants.quantize(w.numpy(), kind)))


def dequantize(state: dict[str, torch.Tensor], value: str | None, where: str) -> dict[str, torch.Tensor]:
    """Float weights from a stored state dict whose config says `weight_storage: value`."""
    if value is None:
        return state
    if value == FP8:
        scales = {k.removesuffix("_scale"): v for k, v in state.items() if k.endswith("_scale")}
        return {k: v.float() * scales[k].float()[:, None] if k in scales else v
                for k, v in state.items() if not k.endswith("_scale")}
    known = [FP8] + [f"ggml_{t}" for t in GGML_TYPES]
    if value not in known:
        raise ValueError(f"{where}: unknown weight_storage {value!r} (known: {', '.join(known)})")
    from gguf import quants

    kind = _ggml_type(value)
    return {k: torch.from_numpy(quants.dequantize(v.cpu().numpy(), kind)).to(v.device) if v.dtype == torch.uint8
            else v for k, v in state.items()}

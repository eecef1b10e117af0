"""KV tensors of a paged cache, one tensor per layer in FlashInfer's NHD layout.

Layer tensor shape: [num_pages, 2, page_size, num_kv_heads, head_dim] (index 0 = K, 1 = V).
With an FP8 (e4m3) cache every layer carries a K and a V scale: write stores value / scale
quantized to e4m3, read returns stored * scale. Page bookkeeping lives in `page_pool.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: values beyond it saturate
# calibrated scales leave this factor of room above the first prefill's max |K|, |V|: later tokens may
# be larger, and e4m3 keeps the same relative precision over its whole range
CALIBRATION_HEADROOM = 4.0


@dataclass
class LayerKV:
    """One layer's cache tensor and its dequantization scales (1.0 unless FP8-calibrated)."""

    data: torch.Tensor  # [num_pages, 2, page_size, num_kv_heads, head_dim]
    k_scale: float = 1.0
    v_scale: float = 1.0
    calibrate_next_write: bool = False  # FP8: derive the scales from the next K/V written (once)

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == FP8_DTYPE

    def quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v in the model dtype -> the cache dtype (scaled and clamped to e4m3 when FP8)."""
        if not self.is_fp8:
            return k.to(self.data.dtype), v.to(self.data.dtype)
        if self.calibrate_next_write:
            self.calibrate_next_write = False
            amax = torch.stack([k.abs().max(), v.abs().max()]).float().tolist()  # one sync, first prefill only
            self.k_scale, self.v_scale = (max(a * CALIBRATION_HEADROOM / FP8_MAX, 1e-6) for a in amax)
        k = (k.float() / self.k_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        v = (v.float() / self.v_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return k, v

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, num_kv_heads, head_dim] at (page, offset) slots; quantizes as needed."""
        k, v = self.quantize(k, v)
        # Indexed writes go through a byte view: index_put is not implemented for float8 on every device.
        raw = self.data.view(torch.uint8) if self.is_fp8 else self.data
        raw[pages, 0, offsets] = k.view(raw.dtype) if self.is_fp8 else k
        raw[pages, 1, offsets] = v.view(raw.dtype) if self.is_fp8 else v

    def read(self, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [n, num_kv_heads, head_dim] of the given slots."""
        k = self.data[pages, 0, offsets].to(dtype)
        v = self.data[pages, 1, offsets].to(dtype)
        if self.is_fp8:
            k, v = k * self.k_scale, v * self.v_scale
        return k, v


class KVCache:
    """The K/V tensors of every layer of one model, sharing one page geometry."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_pages, 2, page_size, num_kv_heads, head_dim)
        self.layers = [LayerKV(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def calibrate_on_first_write(self) -> None:
        for layer in self.layers:
            layer.calibrate_next_write = True

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        for layer, ks, vs in zip(self.layers, k_scales, v_scales, strict=True):
            layer.k_scale, layer.v_scale = float(ks), float(vs)

"""KV tensors of a paged cache, one tensor per layer in FlashInfer's NHD layout.

Layer tensor shape: [num_pages, 2, page_size, num_kv_heads, head_dim] (index 0 = K, 1 = V).
With an FP8 (e4m3) cache every layer carries a K and a V scale: write stores value / scale
quantized to e4m3, read returns stored * scale. Layers may differ in dtype (an FP8 cache that keeps
the layers e4m3 cannot hold well in the model dtype: `layer_dtypes`). Page bookkeeping lives in
`page_pool.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.zero_pages import zeroed

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
        return _to_fp8(k, self.k_scale), _to_fp8(v, self.v_scale)

    def write(self, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, num_kv_heads, head_dim] at (page, offset) slots; quantizes as needed.

        K and V that sit side by side in one buffer (the k|v columns of a fused q|k|v projection) are
        quantized and written as one [n, 2, heads, head_dim] tensor: half the kernels of two writes."""
        pair = _adjacent_pair(k, v)
        if pair is not None and self.k_scale == self.v_scale and not self.calibrate_next_write:
            pair = _to_fp8(pair, self.k_scale) if self.is_fp8 else pair.to(self.data.dtype)
            self._raw()[pages, :, offsets] = self._as_raw(pair)
            return
        k, v = self.quantize(k, v)
        raw = self._raw()
        raw[pages, 0, offsets] = self._as_raw(k)
        raw[pages, 1, offsets] = self._as_raw(v)

    # Indexed writes go through a byte view: index_put is not implemented for float8 on every device.
    def _raw(self) -> torch.Tensor:
        return self.data.view(torch.uint8) if self.is_fp8 else self.data

    def _as_raw(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(torch.uint8) if self.is_fp8 else x

    def rows(self) -> torch.Tensor:
        """The layer as stored, one row per (page, K or V, offset): [num_pages * 2 * page_size, heads * head_dim]."""
        raw = self._raw()
        return raw.view(raw.shape[0] * 2 * raw.shape[2], -1)

    @staticmethod
    def kv_rows(slots: torch.Tensor, page_size: int) -> torch.Tensor:
        """The `rows()` of the K and then the V of slots given as page * page_size + offset: [2 * len(slots)]."""
        page, offset = slots // page_size, slots % page_size
        return torch.cat([page * 2 * page_size + offset, (page * 2 + 1) * page_size + offset])

    def stored(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """K and V [n, 2, num_kv_heads, head_dim] of the given slots as stored (in the cache dtype)."""
        return self._raw()[pages, :, offsets].view(self.data.dtype)

    def read(self, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [n, num_kv_heads, head_dim] of the given slots."""
        k = self.data[pages, 0, offsets].to(dtype)
        v = self.data[pages, 1, offsets].to(dtype)
        if self.is_fp8:
            k, v = k * self.k_scale, v * self.v_scale
        return k, v


def _adjacent_pair(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """k, v [n, heads, head_dim] as one [n, 2, heads, head_dim] view when v's row directly follows k's
    in memory (same buffer, same row stride, each row dense); None otherwise."""
    if k.dim() != 3 or k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype:
        return None
    n, heads, dim = k.shape
    if k.stride(2) != 1 or k.stride(1) != dim or v.data_ptr() != k.data_ptr() + heads * dim * k.element_size():
        return None
    return k.as_strided((n, 2, heads, dim), (k.stride(0), heads * dim, dim, 1))


def _to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Scale, saturate (a plain cast turns out-of-range values into NaN) and cast; the scale of 1.0
    that the cache uses by default costs no multiply."""
    if scale != 1.0:
        x = x * (1.0 / scale)
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def layer_dtypes(num_layers: int, dtype: torch.dtype, full_precision_layers=(), full_dtype: torch.dtype | None = None
                 ) -> tuple[torch.dtype, ...]:
    """Each layer's cache dtype: `dtype`, except `full_precision_layers`, which keep `full_dtype`."""
    return tuple(full_dtype if i in full_precision_layers else dtype for i in range(num_layers))


def _per_layer(dtype: torch.dtype | tuple[torch.dtype, ...], num_layers: int) -> tuple[torch.dtype, ...]:
    """One dtype for every layer, or each layer's already."""
    return dtype if isinstance(dtype, tuple) else (dtype,) * num_layers


class KVCache:
    """The K/V tensors of every layer of one model, sharing one page geometry.

    One page more than `num_pages` is allocated: `scratch_page`, which the pool never hands out, takes
    the K/V writes of padding rows (dummy requests of a CUDA-graph batch, padded draft context). `spare_pages`
    more after it are never handed out either: an attention backend's own (`spare_page_ids`; the FlashInfer
    backend's node pages, `attention/node_rows.py`)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | tuple[torch.dtype, ...],
        device: torch.device | str,
        spare_pages: int = 0,
    ):
        """dtype: one for every layer, or each layer's (`layer_dtypes`)."""
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_dtypes = _per_layer(dtype, num_layers)
        if len(self.layer_dtypes) != num_layers:
            raise ValueError(f"{len(self.layer_dtypes)} layer dtypes for {num_layers} layers")
        self.scratch_page = num_pages
        self.spare_page_ids = list(range(num_pages + 1, num_pages + 1 + spare_pages))
        shape = (num_pages + 1 + spare_pages, 2, page_size, num_kv_heads, head_dim)
        # the layers of one dtype are views of one tensor [layers, *shape]: a row moves in all of them with one
        # indexed copy (`move_rows`) instead of one per layer
        self.stacked = {d: zeroed((self.layer_dtypes.count(d), *shape), d, device)
                        for d in dict.fromkeys(self.layer_dtypes)}
        views = {d: iter(stacked) for d, stacked in self.stacked.items()}  # each dtype's layers in order
        # per dtype, the row (`move_rows`) of each (layer, K or V) at slot 0 of page 0: [layers, K or V], made once
        # (a tree step's moves would launch its few kernels at every step)
        kinds = shape[1]  # K and V
        self._first_rows = {d: (torch.arange(len(stacked), device=device)[:, None] * shape[0] * kinds
                                + torch.arange(kinds, device=device)[None, :]) * page_size
                            for d, stacked in self.stacked.items()}
        self.layers = [LayerKV(next(views[d])) for d in self.layer_dtypes]

    @property
    def is_fp8(self) -> bool:
        """Some layer stores e4m3."""
        return FP8_DTYPE in self.layer_dtypes

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype | tuple[torch.dtype, ...]) -> int:
        return sum(2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=d).element_size()
                   for d in _per_layer(dtype, num_layers))

    def move_rows(self, src_pages: torch.Tensor, src_offsets: torch.Tensor, dst_pages: torch.Tensor,
                  dst_offsets: torch.Tensor) -> None:
        """Every layer's K/V rows from the source slots to the destination slots (a token tree's accepted
        path into consecutive positions): one indexed copy per cache dtype, every source read before any
        destination is written (FP8 rows move as stored). The copy indexes the cache as rows of one (layer, page, K
        or V, offset) each: indexed over its layer dimension too, a cache of more than 2^31 elements took one kernel
        launch per layer for the read and another for the write (torch splits such an indexed copy into parts that
        32-bit offsets address), ~0.2 ms of a tree step of the default target on an H200."""
        for dtype, stacked in self.stacked.items():
            raw = stacked.view(torch.uint8) if dtype == FP8_DTYPE else stacked
            layers, pages, kinds, page_size = raw.shape[:4]
            rows = raw.view(layers * pages * kinds * page_size, -1)
            first = self._first_rows[dtype]

            def row_index(slot_pages: torch.Tensor, slot_offsets: torch.Tensor) -> torch.Tensor:
                # each (layer, K or V)'s first row plus each slot's (page, offset): [layers, K or V, slots]
                return (first[:, :, None] + (slot_pages * kinds * page_size + slot_offsets)[None, None, :]).flatten()

            rows[row_index(dst_pages, dst_offsets)] = rows[row_index(src_pages, src_offsets)]

    def calibrate_on_first_write(self) -> None:
        for layer in self.layers:
            layer.calibrate_next_write = layer.is_fp8

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        for layer, ks, vs in zip(self.layers, k_scales, v_scales, strict=True):
            layer.k_scale, layer.v_scale = float(ks), float(vs)

"""FlashInfer attention over the paged cache (CUDA).

One `BatchPrefillWithPagedKVCacheWrapper` per backend instance serves prompt prefill, target
verify (causal) and DFlash drafting (non-causal): `plan` once per forward step with the whole
batch's per-request lengths, then `run` by every layer. Metadata is int32; indptr and
last_page_len stay on the CPU (plan reads them on the host), page indices go to the GPU.
New K/V are written with `append_paged_kv_cache` (quantized to e4m3 first when the cache is FP8).
FP8 caches pin `backend="fa2"`: the fa3 kernels need FP8 queries, and "auto" sticks to the choice
of the first plan.
"""

from __future__ import annotations

import flashinfer
import torch

from attention.backend import AttentionBackend
from attention.batch_layout import BatchLayout
from attention.kv_cache import FP8_DTYPE, LayerKV

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, *,
                 device: torch.device, kv_dtype: torch.dtype, q_dtype: torch.dtype = torch.bfloat16):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, sm_scale)
        self.device = device
        self.kv_dtype = kv_dtype
        self.q_dtype = q_dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        backend = "fa2" if kv_dtype == FP8_DTYPE else "auto"
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=backend)

    def plan(self, layout: BatchLayout) -> None:
        self.layout = layout
        kv_indices, kv_indptr, last_page_lens = layout.kv_indices(), layout.kv_indptr(), layout.last_page_lens()
        batch_indices = [i for i, n in enumerate(layout.new_kv_lens) for _ in range(n)]
        # one host-to-device copy for everything the kernels read on the GPU
        packed = torch.tensor(kv_indices + kv_indptr + last_page_lens + batch_indices + layout.new_kv_positions(),
                              dtype=torch.int32)
        gpu = packed.pin_memory().to(self.device, non_blocking=True)
        b = layout.batch_size
        sizes = [len(kv_indices), b + 1, b, layout.num_new_kv, layout.num_new_kv]
        (self.kv_indices, self.kv_indptr_gpu, self.last_page_len_gpu, self.batch_indices,
         self.positions) = gpu.split(sizes)
        self.wrapper.plan(torch.tensor(layout.qo_indptr(), dtype=torch.int32),
                          torch.tensor(kv_indptr, dtype=torch.int32), self.kv_indices,
                          torch.tensor(last_page_lens, dtype=torch.int32), self.num_qo_heads,
                          self.num_kv_heads, self.head_dim, layout.page_size, causal=layout.causal,
                          sm_scale=self.sm_scale, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype)

    def write_kv(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        k, v = layer.quantize(k, v)
        flashinfer.append_paged_kv_cache(k, v, self.batch_indices, self.positions, layer.data, self.kv_indices,
                                         self.kv_indptr_gpu, self.last_page_len_gpu, kv_layout="NHD")

    def attend(self, q: torch.Tensor, layer: LayerKV) -> torch.Tensor:
        if layer.is_fp8:
            return self.wrapper.run(q, layer.data, k_scale=layer.k_scale, v_scale=layer.v_scale)
        return self.wrapper.run(q, layer.data)

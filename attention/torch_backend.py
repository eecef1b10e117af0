"""Reference attention in plain torch: gather each request's pages, masked softmax in fp32.

Correct on CPU and GPU, and the oracle the FlashInfer backend is tested against. Requests are
padded to the longest query and KV length of the step so one batched product serves them all.
"""

from __future__ import annotations

import torch

from attention.backend import AttentionBackend
from attention.batch_layout import BatchLayout
from attention.kv_cache import LayerKV


class TorchBackend(AttentionBackend):
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, device="cpu",
                 kv_dtypes: tuple[torch.dtype, ...] = (), q_dtype: torch.dtype | None = None,
                 device_lengths: bool = False, window_left: int = -1):
        # computes in the dtypes it is given, and plans every step exactly: kv_dtypes, q_dtype and
        # device_lengths are accepted for the common signature
        super().__init__(num_qo_heads, num_kv_heads, head_dim, sm_scale, window_left)
        self.device = torch.device(device)

    def plan(self, layout: BatchLayout, write_slots: bool = True) -> None:
        self.layout = layout
        dev = self.device
        self.kv_indices = torch.from_numpy(layout.kv_indices).to(dev)
        self.kv_indptr = torch.from_numpy(layout.kv_indptr()).to(dev)
        if write_slots:
            self.set_write_slots(*layout.new_kv_slots(dev))
        batch, max_q, max_kv = layout.batch_size, int(layout.q_lens.max()), int(layout.kv_lens.max())
        kv_pos = torch.arange(max_kv)
        kv_lens = torch.from_numpy(layout.kv_lens).long()
        q_lens = torch.from_numpy(layout.q_lens).long()
        # page of every (request, kv position); positions past a request's KV read its first page (masked)
        page_index = torch.from_numpy(layout.kv_indptr()[:-1]).long()[:, None] + kv_pos[None, :] // layout.page_size
        in_kv = kv_pos[None, :] < kv_lens[:, None]
        indices = torch.from_numpy(layout.kv_indices).long()
        self.read_pages = torch.where(in_kv, indices[page_index.clamp(max=len(indices) - 1)], 0).to(dev)
        self.read_offsets = (kv_pos % layout.page_size).expand(batch, max_kv).to(dev)
        q_position = (kv_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, max_q]: each query's position
        visible = in_kv[:, None, :]  # [B, 1, max_kv]
        if layout.query_masks is not None:  # earlier KV, and the new rows the mask allows
            first_new = (kv_lens - q_lens)[:, None, None]
            new_row = (kv_pos[None, None, :] - first_new).clamp(min=0, max=max_q - 1).expand(batch, max_q, max_kv)
            allowed = layout.query_masks.cpu().gather(2, new_row)
            visible = visible & ((kv_pos[None, None, :] < first_new) | allowed)
        elif layout.causal:
            visible = visible & (kv_pos[None, None, :] <= q_position[:, :, None])
        if self.window_left >= 0:  # a query at position p sees p - window_left onwards
            visible = visible & (kv_pos[None, None, :] >= q_position[:, :, None] - self.window_left)
        self.visible = visible.expand(batch, max_q, max_kv).to(dev)
        # flat query t of request i <-> padded (i, j)
        self.q_batch = torch.repeat_interleave(torch.arange(batch), q_lens).to(dev)
        self.q_pos = (torch.arange(int(q_lens.sum())) - torch.repeat_interleave(q_lens.cumsum(0) - q_lens, q_lens)).to(dev)
        self.padded_q_shape = (batch, max_q)

    def write_kv(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        layer.write(self.write_pages, self.write_offsets, k, v)

    def attend(self, q: torch.Tensor, layer: LayerKV, out: torch.Tensor | None = None) -> torch.Tensor:
        k, v = layer.read(self.read_pages, self.read_offsets, torch.float32)  # [B, max_kv, Hkv, D]
        group = self.num_qo_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        qp = q.new_zeros(*self.padded_q_shape, *q.shape[1:], dtype=torch.float32)
        qp[self.q_batch, self.q_pos] = q.float()
        scores = torch.einsum("bqhd,bkhd->bhqk", qp, k) * self.sm_scale
        scores = scores.masked_fill(~self.visible[:, None], float("-inf"))
        out_padded = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
        result = out_padded[self.q_batch, self.q_pos].to(q.dtype)
        return result if out is None else out.copy_(result)

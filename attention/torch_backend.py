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
    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, device="cpu"):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, sm_scale)
        self.device = torch.device(device)

    def plan(self, layout: BatchLayout) -> None:
        self.layout = layout
        dev = self.device
        self.write_pages, self.write_offsets = layout.new_kv_slots(dev)
        batch, max_q, max_kv = layout.batch_size, max(layout.q_lens), max(layout.kv_lens)
        kv_pos = torch.arange(max_kv)
        pages = torch.zeros(batch, max_kv, dtype=torch.long)
        for i, (kv, table) in enumerate(zip(layout.kv_lens, layout.page_tables)):
            used = -(-kv // layout.page_size)
            pages[i, :kv] = torch.tensor(table[:used]).repeat_interleave(layout.page_size)[:kv]
        self.read_pages = pages.to(dev)
        self.read_offsets = (kv_pos % layout.page_size).expand(batch, max_kv).to(dev)
        kv_lens = torch.tensor(layout.kv_lens)
        q_lens = torch.tensor(layout.q_lens)
        q_idx = torch.arange(max_q)
        visible = kv_pos[None, None, :] < kv_lens[:, None, None]  # [B, 1, max_kv]
        if layout.causal:
            last_visible = (kv_lens - q_lens)[:, None] + q_idx[None, :]  # [B, max_q]
            visible = visible & (kv_pos[None, None, :] <= last_visible[:, :, None])
        self.visible = visible.expand(batch, max_q, max_kv).to(dev)
        # flat query t of request i <-> padded (i, j)
        rows = [(i, j) for i, q in enumerate(layout.q_lens) for j in range(q)]
        self.q_batch = torch.tensor([r[0] for r in rows], device=dev)
        self.q_pos = torch.tensor([r[1] for r in rows], device=dev)
        self.padded_q_shape = (batch, max_q)

    def write_kv(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        layer.write(self.write_pages, self.write_offsets, k, v)

    def attend(self, q: torch.Tensor, layer: LayerKV) -> torch.Tensor:
        k, v = layer.read(self.read_pages, self.read_offsets, torch.float32)  # [B, max_kv, Hkv, D]
        group = self.num_qo_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2)
        v = v.repeat_interleave(group, dim=2)
        qp = q.new_zeros(*self.padded_q_shape, *q.shape[1:], dtype=torch.float32)
        qp[self.q_batch, self.q_pos] = q.float()
        scores = torch.einsum("bqhd,bkhd->bhqk", qp, k) * self.sm_scale
        scores = scores.masked_fill(~self.visible[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)
        return out[self.q_batch, self.q_pos].to(q.dtype)

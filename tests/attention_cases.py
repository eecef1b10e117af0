"""Shared by the CPU and GPU attention tests: random paged batches and a dense reference."""

from __future__ import annotations

import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import FP8_DTYPE, KVCache
from attention.page_pool import PagePool, PageTable

HQ, HKV, D = 8, 2, 64


def dense_attention(q, k, v, causal: bool, sm_scale: float, window_left: int = -1):
    """q [nq, HQ, D], k/v [nkv, HKV, D] of one request -> [nq, HQ, D], bottom-right causal, fp32; with
    window_left >= 0 the query at position p (its row counted from the end) sees the keys from p - window_left."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    nq, nk = q.shape[0], k.shape[0]
    position = (nk - nq + torch.arange(nq))[:, None]
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        allowed &= torch.arange(nk)[None, :] <= position
    if window_left >= 0:
        allowed &= torch.arange(nk)[None, :] >= position - window_left
    scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedCase:
    """Requests with history already in a paged cache, plus K/V/Q of one new step."""

    def __init__(self, history, new_kv, q_lens, causal, page_size=4, kv_dtype=torch.float32, device="cpu",
                 dtype=torch.float32, seed=0, scales=(1.0, 1.0), num_pages=256, spare_pages=0):
        g = torch.Generator().manual_seed(seed)
        self.pool = PagePool(num_pages, page_size)
        self.kv = KVCache(1, num_pages, page_size, HKV, D, kv_dtype, device, spare_pages=spare_pages)
        self.kv.set_scales([scales[0]], [scales[1]])
        self.layer = self.kv.layers[0]
        self.tables = [PageTable(self.pool) for _ in history]
        # history first, then the new tokens: pages of different requests interleave in the pool
        for t, h in zip(self.tables, history):
            t.grow(h)
        for t, n in zip(self.tables, new_kv):
            t.grow(n)
        self.layout = BatchLayout.build(tuple(q_lens), tuple(t.length for t in self.tables), tuple(new_kv),
                                  tuple(tuple(t.pages) for t in self.tables), page_size, causal)
        total = [t.length for t in self.tables]  # dense K/V per request, as the cache will hold them
        self.k_all = [torch.randn(n, HKV, D, generator=g).to(device, dtype) for n in total]
        self.v_all = [torch.randn(n, HKV, D, generator=g).to(device, dtype) for n in total]
        self.q = torch.randn(sum(q_lens), HQ, D, generator=g).to(device, dtype)
        # history goes in slot by slot (the step under test writes only the new tokens)
        for t, k, v, n in zip(self.tables, self.k_all, self.v_all, new_kv):
            hist = t.length - n
            if hist:
                pages = torch.tensor([t.pages[p // page_size] for p in range(hist)], device=device)
                offs = torch.tensor([p % page_size for p in range(hist)], device=device)
                self.layer.write(pages, offs, k[:hist], v[:hist])
        self.new_k = torch.cat([k[t.length - n:] for t, k, n in zip(self.tables, self.k_all, new_kv)])
        self.new_v = torch.cat([v[t.length - n:] for t, v, n in zip(self.tables, self.v_all, new_kv)])

    def expected(self, sm_scale, window_left: int = -1):
        """Dense attention over what the cache stores (quantize-dequantize round trip for FP8)."""
        outs, start = [], 0
        for k, v, ql in zip(self.k_all, self.v_all, self.layout.q_lens):
            kq, vq = self.layer.quantize(k, v)
            if self.layer.is_fp8:
                kq, vq = kq.float() * self.layer.k_scale, vq.float() * self.layer.v_scale
            outs.append(dense_attention(self.q[start:start + ql], kq, vq, self.layout.causal, sm_scale, window_left))
            start += ql
        return torch.cat(outs)


CASES = {
    # name: (history, new_kv, q_lens, causal)
    "prefill_mixed": ([0, 0, 0], [5, 1, 13], [5, 1, 13], True),
    "decode": ([7, 16, 3, 31], [1, 1, 1, 1], [1, 1, 1, 1], True),
    "verify_page_boundaries": ([3, 12, 17], [16, 16, 16], [16, 16, 16], True),
    "noncausal_block": ([0, 9, 30], [8, 8, 8], [8, 8, 8], False),
    "noncausal_context_plus_block": ([20, 4, 0], [11, 9, 24], [8, 8, 8], False),
}
FP8 = FP8_DTYPE


def random_tree(q: int, generator: torch.Generator) -> torch.Tensor:
    """Masks [q, q] of a random tree whose parents precede their children (node 0 the anchor): each row its
    ancestors and itself."""
    parents = [0] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, q)]
    masks = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        node = i
        masks[i, node] = True
        while node:
            node = parents[node]
            masks[i, node] = True
    return masks

"""DFlash drafting over a paged context cache.

Per request the drafter keeps a context cache (per draft layer, the K/V of the projected target
features of every committed position whose features are known) and the features that arrived
since its last step (`pending`). A draft step, for the whole batch at once:

    KV written:  [pending context n_i ; block bs]  at positions start_i - n_i .. start_i + bs - 1
    queries:     the block [anchor, MASK x (bs-1)] at positions start_i .. start_i + bs - 1
    attention:   non-causal over the request's whole cache (one plan for all layers)

then the block's scratch slots are released, so the cache ends at start_i (the anchor's position),
holding exactly the context positions 0 .. start_i - 1.
"""

from __future__ import annotations

import torch

from attention.backend import make_backend
from attention.batch_layout import BatchLayout
from attention.kv_cache import KVCache
from attention.page_pool import PagePool, PageTable
from drafters.base import Drafter
from drafters.dflash_model import DFlashDraftModel
from specdec.models.decoder import CausalLM
from specdec.request import Request


class DFlashDrafter(Drafter):
    def __init__(self, model: DFlashDraftModel, target: CausalLM):
        self.model = model
        self.target = target
        self.block_size = model.spec.block_size
        self.target_layer_ids = model.spec.target_layer_ids
        self.mask_token_id = model.spec.mask_token_id
        self.tables: dict[int, PageTable] = {}
        self.pending: dict[int, torch.Tensor] = {}  # request id -> [n, F] features not yet in the cache

    # ---- setup -------------------------------------------------------------------------------
    def kv_bytes_per_page(self, page_size: int, kv_dtype: torch.dtype) -> int:
        c = self.model.config
        return KVCache.bytes_per_page(c.num_hidden_layers, page_size, c.num_key_value_heads, self.model.head_dim,
                                      kv_dtype)

    def attach(self, engine) -> None:
        c = self.model.config
        self.device = engine.device
        self.pool = PagePool(engine.num_pages, engine.pool.page_size)
        self.kv = KVCache(c.num_hidden_layers, engine.num_pages, engine.pool.page_size, c.num_key_value_heads,
                          self.model.head_dim, engine.kv_dtype, engine.device)
        if engine.config.calibrate_fp8_scales and self.kv.is_fp8:
            self.kv.calibrate_on_first_write()
        self.attn = make_backend(engine.backend_name, num_qo_heads=c.num_attention_heads,
                                 num_kv_heads=c.num_key_value_heads, head_dim=self.model.head_dim,
                                 sm_scale=self.model.head_dim ** -0.5, device=engine.device,
                                 kv_dtype=engine.kv_dtype, q_dtype=engine.dtype)
        if engine.backend_name == "flashinfer" and not self.model.fused_kernels:
            self.model.use_fused_kernels()
        # block positions run up to the target's context plus one block
        self.model.rotary.max_positions = engine.max_context + self.block_size

    # ---- lifecycle ---------------------------------------------------------------------------
    def begin(self, requests: list[Request], prompt_features: list[torch.Tensor]) -> None:
        for request, features in zip(requests, prompt_features):
            self.tables[request.request_id] = PageTable(self.pool)
            self.pending[request.request_id] = features

    def extend(self, requests: list[Request], features: list[torch.Tensor]) -> None:
        for request, f in zip(requests, features):
            self.pending[request.request_id] = torch.cat([self.pending[request.request_id], f])

    def release(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, None)
        if table is not None:
            table.free()
        self.pending.pop(request.request_id, None)

    # ---- drafting ----------------------------------------------------------------------------
    def propose(self, requests: list[Request]) -> torch.Tensor:
        return self.draft_logits(requests).argmax(dim=-1)

    @torch.no_grad()
    def draft_logits(self, requests: list[Request]) -> torch.Tensor:
        """One draft step for the batch: logits [B, bs-1, vocab] for block positions 1..bs-1."""
        bs, dev = self.block_size, self.device
        tables = [self.tables[r.request_id] for r in requests]
        context = [self.pending[r.request_id] for r in requests]
        starts = [r.num_cached for r in requests]  # the anchor's position
        for table, ctx, start in zip(tables, context, starts):
            assert table.length + len(ctx) == start, "drafter context out of step with the target"
            table.grow(len(ctx) + bs)
        n_ctx = [len(c) for c in context]
        layout = BatchLayout(q_lens=(bs,) * len(requests), kv_lens=tuple(t.length for t in tables),
                             new_kv_lens=tuple(n + bs for n in n_ctx),
                             page_tables=tuple(tuple(t.pages) for t in tables), page_size=self.pool.page_size,
                             causal=False)
        self.attn.plan(layout)
        block_ids = torch.full((len(requests), bs), self.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = torch.tensor([r.pending_token for r in requests], device=dev)
        ctx_pos = [p for n, s in zip(n_ctx, starts) for p in range(s - n, s)]
        blk_pos = [s + k for s in starts for k in range(bs)]
        hidden = self._forward(torch.cat(context), block_ids.flatten(), ctx_pos, blk_pos, n_ctx)
        logits = self.model.block_logits(hidden.view(len(requests), bs, -1)[:, 1:].reshape(-1, hidden.shape[-1]),
                                         self.target.lm_head).view(len(requests), bs - 1, -1)
        for request, table, ctx, start in zip(requests, tables, context, starts):
            table.truncate(start)  # release the block's scratch slots; the context stays
            self.pending[request.request_id] = ctx[:0]
        return logits

    def _forward(self, context_features, block_ids, ctx_pos, blk_pos, n_ctx) -> torch.Tensor:
        """Run the draft layers; returns the block's final hidden states [B * bs, hidden] (pre-norm)."""
        m, dev, bs = self.model, self.device, self.block_size
        dtype = m.fc.weight.dtype
        ctx = m.project_context(context_features.to(dtype))
        x = self.target.embed(block_ids).to(dtype) * m.spec.input_embedding_scale
        ctx_rope = m.rotary.at(torch.tensor(ctx_pos, device=dev), dtype)
        blk_rope = m.rotary.at(torch.tensor(blk_pos, device=dev), dtype, fused=m.fused_kernels)
        order = self._kv_order(n_ctx, bs)
        residual = None
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            h, residual = layer.input_layernorm.add_and_norm(x, residual)
            q, k_blk, v_blk = attn.project(h, blk_rope)
            k_ctx, v_ctx = attn.project_kv(ctx, ctx_rope)  # the context skips input_layernorm and the MLP
            k = torch.cat([k_ctx, k_blk]).index_select(0, order)
            v = torch.cat([v_ctx, v_blk]).index_select(0, order)
            self.attn.write_kv(self.kv.layers[i], k, v)
            h, residual = layer.post_attention_layernorm.add_and_norm(
                attn.output(self.attn.attend(q, self.kv.layers[i])), residual)
            x = layer.mlp(h)
        return x + residual

    def _kv_order(self, n_ctx: list[int], bs: int) -> torch.Tensor:
        """Index into cat([all context rows, all block rows]) giving request-by-request [ctx_i ; block_i]."""
        total_ctx, order, offset = sum(n_ctx), [], 0
        for i, n in enumerate(n_ctx):
            order += range(offset, offset + n)
            order += range(total_ctx + i * bs, total_ctx + (i + 1) * bs)
            offset += n
        return torch.tensor(order, dtype=torch.long, device=self.device)

"""What every model runner has: one network's attention backend, its paged KV cache, and the CUDA
graph ladders of its fixed-shape steps with the graph/eager dispatch between them.

    runner = ModelRunner(model, backend_name=..., kv_dtype=..., page_size=16, max_batch=64)
    runner.allocate_kv(num_pages)                       # once the engine has sized the pool
    runner.capture_ladder("step", "name", dummy, rows, body, pool)   # at start-up (CUDA only)
    ...fill the step's StaticInputs on the host...
    runner.dispatch("step", batch, layout, inputs)      # graph replay of the next larger rung, or eager

A subclass keeps the step itself (`body(batch)`: reads only static inputs and the planned page
metadata, writes static outputs), so the same function runs inside a graph and eagerly. The target
runner (`target_runner.py`) and the DFlash drafter (`drafters/dflash.py`) are the two subclasses.
"""

from __future__ import annotations

from typing import Callable

import torch

from attention import make_backend
from attention.batch_layout import BatchLayout
from attention.kv_cache import KVCache
from specdec.runtime.cuda_graphs import GraphLadder, StaticInputs, graph_max_pages, ladder_sizes


class ModelRunner:
    """`model` has a transformers-style `config` (heads, layers), `head_dim`, `rotary` and the
    `fused_kernels` switch (`specdec.models.decoder.CausalLM` and the DFlash draft network do)."""

    def __init__(self, model, *, backend_name: str, kv_dtype: torch.dtype, q_dtype: torch.dtype,
                 page_size: int, max_batch: int, device: torch.device):
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        self.max_batch = max_batch
        c = model.config
        self.attn = make_backend(backend_name, num_qo_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                 head_dim=model.head_dim, sm_scale=model.head_dim ** -0.5, device=device,
                                 kv_dtype=kv_dtype, q_dtype=q_dtype)
        if backend_name == "flashinfer" and not model.fused_kernels:
            model.use_fused_kernels()  # FlashInfer's norm / rope / activation kernels on the same path
        self.kv: KVCache | None = None
        self.ladders: dict[object, GraphLadder] = {}

    # ---- the KV cache ------------------------------------------------------------------------
    def kv_bytes_per_page(self) -> int:
        c = self.model.config
        return KVCache.bytes_per_page(c.num_hidden_layers, self.page_size, c.num_key_value_heads, self.model.head_dim,
                                      self.kv_dtype)

    def allocate_kv(self, num_pages: int, calibrate_fp8_scales: bool = False) -> None:
        c = self.model.config
        self.kv = KVCache(c.num_hidden_layers, num_pages, self.page_size, c.num_key_value_heads, self.model.head_dim,
                          self.kv_dtype, self.device)
        if calibrate_fp8_scales and self.kv.is_fp8:
            self.kv.calibrate_on_first_write()

    # ---- fixed-shape steps -------------------------------------------------------------------
    def capture_ladder(self, key, name: str, dummy_layout: Callable[[int, int], BatchLayout],
                       new_rows_per_request: int, body: Callable[[int], object], pool) -> float:
        """Capture `body` over the batch ladder as step `key`; `dummy_layout(batch, scratch_page)` is a
        padding-only layout of the step. Returns seconds."""
        scratch = self.kv.scratch_page
        ladder = GraphLadder(name, ladder_sizes(self.max_batch), self.attn,
                             graph_max_pages(self.kv.num_pages, self.max_batch, new_rows_per_request, self.page_size),
                             lambda batch: dummy_layout(batch, scratch), body, pool)
        seconds = ladder.capture(scratch)
        self.ladders[key] = ladder
        return seconds

    def dispatch(self, key, batch: int, layout: BatchLayout, inputs: StaticInputs, body: Callable[[int], object], *,
                 eager: bool = False, after_upload: Callable[[], None] | None = None):
        """Run step `key` for `batch` requests: plan `layout`, send the static inputs (then
        `after_upload`, for inputs already on the device), and replay the graph of the smallest rung
        that fits, else run `body` eagerly. Returns what an eager `body` returned (None on replay)."""
        ladder = self.ladders.get(key)
        rung = ladder.rung_for(batch) if ladder is not None and not eager else None
        if rung is not None:
            self.attn.plan_graph(ladder.slot(rung), layout, self.kv.scratch_page)
        else:
            self.attn.plan(layout, write_slots=False)  # the step computes its write slots on the device
        inputs.upload()
        if after_upload is not None:
            after_upload()
        if rung is not None:
            ladder.replay(rung)
            return None
        return body(batch)

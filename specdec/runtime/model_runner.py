"""What every model runner has: one network's attention backend, its paged KV cache, and the CUDA
graphs of its steps with the graph/eager dispatch between them.

    runner = ModelRunner(model, backend_name=..., kv_dtype=..., page_size=16, max_batch=64)
    runner.graph_memory()                               # before the pool is sized: what the graphs will hold
    runner.allocate_kv(num_pages)                       # once the engine has sized the pool
    runner.capture(pool)                                # every step's graphs (CUDA only)
    ...fill the step's StaticInputs on the host...
    runner.dispatch("step", batch, layout, inputs)      # a fixed step: replay of the next larger rung, or eager
    runner.run_tokens(token_step, tokens)               # a token step: piecewise replay, or eager

Two kinds of step. A fixed step (`fixed_steps`: the same query count for every request, e.g. decode or
verify) is captured whole over a ladder of batch sizes; its `body(batch)` reads only static inputs and
the planned page metadata and writes static outputs. A token step (`token_steps`: ragged requests,
e.g. prompt chunks riding along a decode) is captured over a ladder of token counts, cut at attention
(`piecewise_graphs.py`); its `body(size, cut)` likewise. Either body runs inside a graph and eagerly.
The target runner (`target_runner.py`) and the DFlash drafter (`drafters/dflash.py`) are the two
subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attention import make_backend
from attention.batch_layout import BatchLayout
from attention.kv_cache import KVCache
from specdec.runtime.cuda_graphs import GraphLadder, StaticInputs, gpu_seconds, graph_max_pages, ladder_sizes
from specdec.runtime.piecewise_graphs import Cut, PiecewiseGraphs, skip_gaps, token_sizes

SLOT_INDEX_BYTES_PER_PAGE = 4  # a graph rung's page-index buffer holds an int32 for every KV page
# what the caching allocator rounds a rung's buffers up to beyond their bytes (buffers of 1-10 MiB share 20 MiB
# segments): 1.3-2.8 MiB per rung measured on an H200 (tiny model, 1.4M pages, 15 rungs per step)
SLOT_ROUNDING_BYTES = 3 << 20
# what capturing takes beyond the eager peak: cuBLAS's workspace on the capture stream and the
# allocator's rounding (56-79 MiB measured on an H200 with a tiny model at max_num_seqs 256)
CAPTURE_OVERHEAD_BYTES = 128 << 20


@dataclass(frozen=True)
class GraphMemory:
    """GPU memory that CUDA graphs take beside the KV pool: the shared pool of their activations, the
    attention backend's per-rung buffers, and their page indices (bytes per KV page)."""

    pool: int = 0
    slots: int = 0
    per_page: int = 0


@dataclass(frozen=True)
class TokenStep:
    """A step of any token count up to `max_tokens` (ragged requests), captured as piecewise graphs over
    a ladder of token counts (`piecewise_graphs.py`). `body(size, cut)` reads `inputs` (staged per step;
    their "positions", "pages" and "offsets" by `stage_token_rows`, "pages" pointing at the scratch page
    while capturing) and writes static buffers; eagerly it runs with the real token count and its gaps in place."""

    key: object
    name: str
    max_tokens: int
    inputs: StaticInputs
    body: Callable[[int, Cut], None]


@dataclass(frozen=True)
class FixedStep:
    key: object  # the step's name in `ladders` and `dispatch`
    name: str  # for logs
    dummy_layout: Callable[[int, int], BatchLayout]  # (batch, scratch_page) -> a padding-only layout
    new_rows_per_request: int  # K/V rows a request writes (sizes the graph slots' page room)
    body: Callable[[int], object]
    max_rung: int = 0  # the largest batch captured (0: every rung up to max_batch)


class ModelRunner:
    """`model` has a transformers-style `config` (heads, layers), `head_dim`, `rotary` and the
    `fused_kernels` switch (`specdec.models.decoder.CausalLM` and the DFlash draft network do)."""

    def __init__(self, model, *, backend_name: str, kv_dtype: torch.dtype | tuple[torch.dtype, ...],
                 q_dtype: torch.dtype, page_size: int, max_batch: int, device: torch.device,
                 device_lengths: bool = False, window_left: int = -1):
        """kv_dtype: the cache's dtype, or each layer's (`attention.kv_cache.layer_dtypes`); device_lengths: graph
        steps may be planned for upper bounds of their KV lengths (`AttentionBackend.use_device_lengths`);
        window_left: the attention's sliding window (`AttentionBackend`)."""
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        self.max_batch = max_batch
        c = model.config
        self.attn = make_backend(backend_name, num_qo_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                 head_dim=model.head_dim, sm_scale=model.head_dim ** -0.5, device=device,
                                 kv_dtypes=kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype,), q_dtype=q_dtype,
                                 device_lengths=device_lengths, window_left=window_left)
        if backend_name == "flashinfer" and not model.fused_kernels:
            model.use_fused_kernels()  # FlashInfer's norm / rope / activation kernels on the same path
        self.kv: KVCache | None = None
        self.spare_pages = 0  # KV pages outside the pool the backend asked for (`AttentionBackend.spare_pages_wanted`)
        self.ladders: dict[object, GraphLadder] = {}
        self.token_graphs: dict[object, PiecewiseGraphs] = {}

    # ---- the KV cache ------------------------------------------------------------------------
    def kv_bytes_per_page(self) -> int:
        c = self.model.config
        return KVCache.bytes_per_page(c.num_hidden_layers, self.page_size, c.num_key_value_heads, self.model.head_dim,
                                      self.kv_dtype)

    def allocate_kv(self, num_pages: int, calibrate_fp8_scales: bool = False) -> None:
        c = self.model.config
        self.kv = KVCache(c.num_hidden_layers, num_pages, self.page_size, c.num_key_value_heads, self.model.head_dim,
                          self.kv_dtype, self.device, spare_pages=self.spare_pages)
        if self.spare_pages:
            self.attn.use_spare_pages(self.kv.spare_page_ids)
        if calibrate_fp8_scales and self.kv.is_fp8:
            self.kv.calibrate_on_first_write()

    # ---- steps captured as CUDA graphs -------------------------------------------------------
    def fixed_steps(self) -> list[FixedStep]:
        """The steps of a fixed shape, captured over the batch ladder (none by default)."""
        return []

    def token_steps(self) -> list[TokenStep]:
        """The steps of a ragged shape, captured piecewise over token counts (none by default)."""
        return []

    def capture(self, pool) -> float:
        """Capture every step into `pool` (the token steps first: their activations are the largest, and
        later graphs reuse that memory); returns seconds."""
        seconds = 0.0
        for step in self.token_steps():
            step.inputs.fill("pages", [], pad=self.kv.scratch_page)  # capturing writes nothing real
            step.inputs.upload()
            graphs = PiecewiseGraphs(step.name, token_sizes(step.max_tokens), pool)
            seconds += graphs.capture(step.body)
            self.token_graphs[step.key] = graphs
        return seconds + sum(self._capture_ladder(step, pool) for step in self.fixed_steps())

    def _capture_ladder(self, step: FixedStep, pool) -> float:
        scratch = self.kv.scratch_page
        sizes = tuple(s for s in ladder_sizes(self.max_batch) if not step.max_rung or s <= step.max_rung)
        ladder = GraphLadder(step.name, sizes, self.attn,
                             graph_max_pages(self.kv.num_pages, self.max_batch, step.new_rows_per_request,
                                             self.page_size),
                             lambda batch: step.dummy_layout(batch, scratch), step.body, pool)
        seconds = ladder.capture(scratch)
        self.ladders[step.key] = ladder
        return seconds

    def replay_seconds(self, key) -> dict[int, float]:
        """GPU seconds of one replay of step `key`'s graph at each rung (`gpu_seconds`), on the dummy layout
        it was captured with (its writes go to the scratch page); empty without graphs."""
        ladder = self.ladders.get(key)
        if ladder is None:
            return {}
        seconds = {}
        for rung in ladder.sizes:
            self.attn.plan_graph(ladder.slot(rung), ladder.dummy_layout(rung), self.kv.scratch_page)
            seconds[rung] = gpu_seconds(lambda: ladder.replay(rung))
        return seconds

    def graph_memory(self) -> GraphMemory:
        """What the CUDA graphs of the steps will hold, measured before the KV pool is sized (CUDA)."""
        steps, token_steps = self.fixed_steps(), self.token_steps()
        if not steps and not token_steps:
            return GraphMemory()
        pool = self._graph_pool_bytes(steps, token_steps) + CAPTURE_OVERHEAD_BYTES
        if not steps:
            return GraphMemory(pool)
        rungs = len(ladder_sizes(self.max_batch)) * len(steps)
        return GraphMemory(pool, rungs * (self._largest_slot_bytes(steps) + SLOT_ROUNDING_BYTES),
                           rungs * SLOT_INDEX_BYTES_PER_PAGE)

    def _graph_pool_bytes(self, steps: list[FixedStep], token_steps: list[TokenStep]) -> int:
        """The most that one step allocates at its largest shape, run once eagerly over a one-page KV
        cache (token steps without their gaps, which run outside the graphs). The graphs share one pool
        and are captured largest first, so the largest step decides."""
        self.allocate_kv(1)
        try:
            return max([self.peak_bytes(lambda s=step: self._run_dummy(s)) for step in steps]
                       + [self.peak_bytes(lambda s=step: s.body(token_sizes(s.max_tokens)[-1], skip_gaps))
                          for step in token_steps])
        finally:
            self.kv = None

    def _run_dummy(self, step: FixedStep) -> None:
        batch = min(self.max_batch, step.max_rung or self.max_batch)
        self.attn.plan(step.dummy_layout(batch, self.kv.scratch_page), write_slots=False)
        step.body(batch)

    def peak_bytes(self, run: Callable[[], object]) -> int:
        """GPU memory that `run` allocates at its peak beyond what was allocated before it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    def _largest_slot_bytes(self, steps: list[FixedStep]) -> int:
        """The attention backend's buffers of one graph rung at max_batch (workspaces, index buffers),
        less their page indices, which are counted per KV page."""
        rows = max(step.new_rows_per_request for step in steps)
        before = torch.cuda.memory_allocated(self.device)
        slot = self.attn.graph_slot(self.max_batch, graph_max_pages(0, self.max_batch, rows, self.page_size))
        size = torch.cuda.memory_allocated(self.device) - before
        del slot
        return size

    def rung_for(self, key, batch: int) -> int | None:
        """The captured rung of step `key` that replays `batch` requests (None: the step runs eagerly)."""
        ladder = self.ladders.get(key)
        return ladder.rung_for(batch) if ladder is not None else None

    def replays(self, key, batch: int) -> bool:
        """Whether `dispatch` of step `key` for `batch` requests replays a graph (rather than running eagerly)."""
        return self.rung_for(key, batch) is not None

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

    def stage_token_rows(self, step: TokenStep, layout: BatchLayout) -> int:
        """Stage the positions and K/V write slots of `layout`'s new tokens in the step's inputs (rows past
        them write to the scratch page); returns how many rows that is. The caller fills the rest of its
        inputs and uploads them."""
        return self.stage_token_places(step, *layout.new_kv_places())

    def stage_token_places(self, step: TokenStep, positions, pages, offsets) -> int:
        """Stage new tokens given by their positions and K/V write slots (page, offset) in the step's inputs, as
        `stage_token_rows` does; returns how many rows that is."""
        step.inputs.fill("positions", positions)
        step.inputs.fill("pages", pages, pad=self.kv.scratch_page)
        step.inputs.fill("offsets", offsets)
        return len(positions)

    def run_tokens(self, step: TokenStep, tokens: int, *, eager: bool = False) -> None:
        """Run token step `step` over its first `tokens` staged rows: the piecewise graphs of the smallest
        captured count that fits, else its body eagerly (each gap in place)."""
        graphs = self.token_graphs.get(step.key)
        size = graphs.size_for(tokens) if graphs is not None and not eager else None
        if size is None:
            step.body(tokens, lambda gap: gap(tokens))
        else:
            graphs.replay(size, tokens)

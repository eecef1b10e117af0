"""FlashInfer attention over the paged cache (CUDA).

One `BatchPrefillWithPagedKVCacheWrapper` serves prompt prefill, target verify (causal) and DFlash
drafting (non-causal): `plan` once per forward step with the whole batch's per-request lengths,
then `run` by every layer (an eager step's later layers call the kernel of its first layer's run directly, with
the arguments that run derived: attention/planned_run.py). Eager steps use one wrapper; each CUDA-graph rung (a
fixed batch size) has its own `GraphSlot`: a wrapper built with `use_cuda_graph=True` over index buffers at fixed
addresses, planned on the host before every replay. All wrappers of a backend share one float
workspace (steps never overlap). Host metadata reaches the GPU only from pinned memory with
non-blocking copies, so planning never synchronizes the host with the GPU.
Kernels: "auto" (fa3 on Hopper) for bf16/fp16 caches, "fa2" for FP8 (fa3 needs FP8 queries; "auto"
would stick to the choice of its first plan).
A cache whose layers mix dtypes (FP8 with a few layers kept in the model dtype) has one wrapper per
dtype, planned together for the same layout; each layer runs the wrapper of its own dtype.
fa2 splits a request's KV over several CTAs and merges them; fa3 gives each 128-row query tile one CTA that
walks the whole KV, so it needs many query rows to fill the GPU. Per layer of the default target on an H200
(`scripts/bench_attention.py`): a lone decode at 6k context 10 us with fa2 against 85 us with fa3, a cached
turn of 40 new tokens over 6k 18 against 85 us, a prompt arriving among 64 verifies of 4 tokens 31 against
82 us (among 256 verifies of 2: 68 against 348 us); fa3 wins only on large prefills (a cold prompt of 700
tokens 17 against 40 us, of 6k 244 against 447 us; 8 cached turns of 100 new tokens 88 against 132 us).
So every step runs fa2 but for prefills of enough query rows (`prefill_heavy`). A lone request's decode or
verify must also give each position the same bits whether it has 1 query or a block: greedy speculation then
reproduces greedy decoding token for token at batch 1 (in a batch the promise is bounded anyway, since GEMMs
tile by row count). fa2 tiles by query count, so such a step runs as its query rows (`BatchLayout.query_rows`):
one request per query, each over its KV up to its own position, the KV cut into chunks of a size fixed by the
request's expected length (`rows_split_pages`): a decode and the verify row of the same position then run the
same kernel over the same chunks. fa3 computes them alike too, with one CTA walking the whole KV: per layer
of the default target's shape on an H200, 29 us for a decode at 1,500 tokens of context, where the rows take
10 (decode) and 15 (a verify of 16); a plain decode step at 6,000 tokens went from 4.30 to 2.35 ms. Planning
the rows costs ~0.1 ms more host time than fa3's plan (BENCHMARKS.md). A rung keeps its plan while every row
has as many KV chunks as at that plan (`kv_split`, true for most steps: a row gains a chunk every few hundred
tokens): FlashInfer derives its work items from those counts, and its kernels read the lengths from the page
metadata, which is all such a step sends. A graph rung's index buffers are views of one device tensor, filled
from pinned memory in one copy per plan (`StagedIndices`). Both shorten the host's path between a step's tokens
reaching it and the next verify's launch, where at batch 1 the GPU runs only the queued draft (~0.43 ms): a
verify's `plan_graph` took 0.31 ms before and 0.21-0.24 ms with the kept plan (two H200s, BENCHMARKS.md).
A backend whose runner bounds no request's pages (`bound_sequence_pages`), or that has a sliding window, keeps
fa3 for them. Eager and graphed steps of the same layout use the same kernels.
The decodes or verifies of at least ONE_PIECE_MIN_BATCH requests keep each request's KV in one piece (fa2 without
split-KV): so many requests fill the GPU's SMs without splitting, and FlashInfer's plan of such a step then depends
on its query counts alone (a graph rung's are the same at every step), so the rung keeps its plan and a step sends
only its page metadata: FlashInfer's plan is host time on the path of every step (at 256 requests an overlapped
plain step's host work is about as long as its GPU work). A request's KV in one piece is one CTA's walk, so a request
far longer than the others would make the whole step wait for it: a step where one is more than ONE_PIECE_MAX_EXCESS
tokens longer than the batch's mean is planned with split-KV (`even_lengths`), and such a rung declines to replay it
(`graph_fits`; the target runs it as a mixed step, its attention planned between piecewise graphs). Steps with prompt
chunks keep split-KV: a prompt of 200 tokens arriving among 64 verifies of 4 over contexts of 200-1,500 tokens took
41.6 us a layer split against 49.2 in one piece, where those verifies alone take 37.5 against 36.2
(`scripts/bench_attention.py`, an H200).
fa2 graph slots are planned with `uniform_q_len` (every request has the same query count), so the
query tile is sized for that count as in an eager plan: without it a CUDA-graph plan sizes the tile
for the ragged worst case, the verify graph then rounds differently from the decode graph, and
greedy speculation with FP8 KV matched greedy decoding on only 11 of 24 SmolLM2 prompts (eager: 24).

A lone request's token tree of up to LONE_ROWS_MAX rows, where the cache holds node pages (`use_spare_pages`), runs
as node rows (`attention/node_rows.py`): one query row per node over the context's full pages and then its own pages,
which every layer fills with the context's tail and the node's path before it attends, in the query rows' KV chunks:
each node gets the bits of a decode at its position. The tree's shape is on the device only, so a graph rung plans
every node at the deepest node's length and the step writes each node's real page metadata from the masks
(`use_device_tree`); where its nodes would not all have the deepest node's KV chunk count the rung declines a tree of
any shape (`graph_fits`), and takes one whose nodes form a chain (`BatchLayout.chain_masks`: the host plans their
depths; the tree step makes its tree so there). An eager plan reads the depths back.
Any other token-tree step (`BatchLayout.query_masks`) is attended in two parts merged by their log-sum-exps
(`flashinfer.merge_state_in_place`), as cascade attention does: the context, every query over its request's
KV before the step (the paged fa2 wrappers, no mask, split over the KV like any fa2 step), and the tree, every
query over the step's own rows as stored, under its mask (a ragged fa2 wrapper with a custom mask of n x n
bits per request). One paged plan with a mask over the whole KV would make the host build and pack
queries x context bits every step, and its kernel walks the mask for every KV tile. A lone request's context
part runs in KV chunks of a fixed size (`tree_split_pages`), so that its graph rung keeps its plan while the chunk
count holds; the tree part keeps its plan per tree size, and its masks come packed from the graph that builds the
trees (`BatchLayout.packed_masks`).

A backend made with `device_lengths` (the DFlash drafter's) runs fa2 for every step, whose kernels read each
request's KV length from the page metadata on the device when they run: a graph rung may then be planned for
upper bounds of the lengths (the next draft step, queued before the verify's acceptance reaches the host), and
the step itself writes the real page metadata into the rung's buffers first (`use_device_lengths`). Its plans
keep each request's KV in one piece (no split-KV): a split kernel lays out its partial results by the number of
KV chunks it derives from the real length, while the plan sized and merges them by the planned one.
"""

from __future__ import annotations

from typing import Callable

import flashinfer
import numpy as np
import torch

from attention.backend import AttentionBackend
from attention.batch_layout import (BatchLayout, slots_on_device, write_node_row_metadata, write_query_row_metadata,
                                    write_real_page_metadata)
from attention.fused import fused_if, fusing
from attention.kv_cache import FP8_DTYPE, LayerKV
from attention.node_rows import NodeRowCopies, chunks_agree, node_pages_per_row, node_rows_layout
from attention.planned_run import PlannedRun
from attention.transfer import CopyFence, StagedIndices, pinned, upload

WORKSPACE_BYTES = 256 << 20


def _keep_mask_offsets_pinned() -> None:
    """FlashInfer derives a custom mask's per-request offsets on the host, in pageable memory, and copies them
    to the GPU when a plan has a mask. From pageable memory the driver may make that copy wait for the
    stream (everything queued before it), which would hold a tree step's planning until its drafting has
    run on the GPU; the offsets returned pinned keep it asynchronous, as every other plan input is here."""
    prefill = getattr(flashinfer, "prefill", None)
    compute = getattr(prefill, "_compute_mask_indptr", None)
    if compute is None or getattr(compute, "returns_pinned", False):
        return

    def pinned_offsets(*args, **kwargs):
        offsets = compute(*args, **kwargs)
        return offsets.pin_memory() if offsets.device.type == "cpu" and torch.cuda.is_available() else offsets

    pinned_offsets.returns_pinned = True
    prefill._compute_mask_indptr = pinned_offsets


_keep_mask_offsets_pinned()


class GraphSlot:
    """The wrappers (one per cache dtype) and index buffers of one CUDA-graph batch size (their addresses
    never change), and pinned host buffers to plan from (reused once the copies of the slot's last plan have
    run: `host_fence`; a draft queued ahead is planned before the step's wait, and its copies may still be
    queued). A token-tree rung (`tree`) plans its paged wrappers for the trees' context part, over
    buffers of their own, and keeps the step's page metadata (what its write slots and K/V moves read) in
    `kv_indptr` / `kv_indices`; its tree part has ragged wrappers with a custom mask of `example`'s tree size,
    planned once per tree size (later steps write only their masks)."""

    def __init__(self, backend: "FlashInferBackend", batch_size: int, max_pages: int, fa2: bool,
                 tree_size: int = 0, rows: int = 0, one_piece: bool = False, node_rows: bool = False,
                 page_size: int = 0):
        dev = backend.device
        self.batch_size = batch_size
        self.one_piece = one_piece  # each request's KV in one piece: the plan depends on the query counts alone
        self.tree_size = tree_size  # a token-tree rung's tokens per request (0: not a tree rung)
        self.tree = tree_size > 0
        self.rows = rows  # a lone request's rung planned as its query rows: queries per step (0: not such a rung)
        self.node_rows = node_rows  # those rows are a token tree's nodes (`attention/node_rows.py`)
        self.page_size = page_size  # a node-rows rung's steps' (what its KV chunk check counts pages in)
        # what the paged wrappers read: the step's own metadata, or a tree's context part's, or the query rows'
        # (one request per query, one without; each at most the longest request's pages, the last two chunks, which
        # round up to a page more at most); sent in one copy per plan, the page indices last
        planned_batch = rows + 1 if rows else batch_size
        planned_pages = (rows + 2) * (backend.rows_pages + 1) if rows else max_pages
        # (a node-rows rung also sends the tokens before the step, what its nodes' real lengths start from)
        self.index = StagedIndices({"qo_indptr": planned_batch + 1, "kv_indptr": planned_batch + 1,
                                    "last_page_len": planned_batch, **({"context": 1} if node_rows else {}),
                                    "kv_indices": planned_pages}, dev, ones=("last_page_len",))
        # a node-rows rung's tree: which nodes each node sees, copied from the step's masks at every plan
        self.node_masks = torch.zeros(rows, rows, dtype=torch.bool, device=dev) if node_rows else None
        self.qo_indptr = self.index["qo_indptr"]
        self.planned = (self.index["kv_indptr"], self.index["kv_indices"], self.index["last_page_len"])
        # the step's own page metadata (what its write slots and K/V moves read): the planned one, or apart from it
        self.step_index = StagedIndices({"kv_indptr": batch_size + 1, "kv_indices": max_pages}, dev) \
            if self.tree or rows else None
        if self.step_index is None:
            self.kv_indptr, self.kv_indices, self.last_page_len = self.planned
        else:
            self.kv_indptr, self.kv_indices = self.step_index["kv_indptr"], self.step_index["kv_indices"]
            self.last_page_len = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.kv_lens = torch.zeros(planned_batch, dtype=torch.int32, pin_memory=dev.type == "cuda")  # plans read it
        # one wrapper per cache dtype over the same index buffers (each plan writes the same values), made
        # here so that the graph memory estimate counts them; the kernel is the rung's (`FlashInferBackend.fa2`)
        self.fa2 = fa2
        self.host_fence = CopyFence(dev)  # marked after the copies of the slot's last plan
        kv_indptr, kv_indices, last_page_len = self.planned
        self.wrappers = {dtype: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            backend.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices, paged_kv_last_page_len_buf=last_page_len,
            backend=kernel_backend(dtype, fa2)) for dtype in backend.kv_dtypes}
        self.tree_wrappers = {}
        # the tree size the tree part was last planned for: its plan depends on nothing else (every request of a
        # rung has that many rows), so later steps of that size only write their masks into `tree_masks`
        self.tree_planned = 0
        # what the slot's last plan derived its work from (a query-rows rung's split, `kv_split`; a one-piece rung's
        # query counts): a step of the same keeps that plan
        self.split: bytes | None = None
        if self.tree:
            tree_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
            self.tree_masks = torch.zeros(batch_size * tree_size * tree_size, dtype=torch.uint8, device=dev)
            mask_indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=dev)
            self.tree_wrappers = {dtype: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                backend.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=tree_indptr, kv_indptr_buf=tree_indptr,
                custom_mask_buf=self.tree_masks, mask_indptr_buf=mask_indptr, backend="fa2")
                for dtype in backend.kv_dtypes}


class FlashInferBackend(AttentionBackend):
    supports_graphs = True

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, *,
                 device: torch.device, kv_dtypes: tuple[torch.dtype, ...], q_dtype: torch.dtype = torch.bfloat16,
                 device_lengths: bool = False, window_left: int = -1):
        super().__init__(num_qo_heads, num_kv_heads, head_dim, sm_scale, window_left)
        self.device = device
        # a lone request's graphed node-row metadata and copies as a few fused kernels (`attention.fused`)
        self.fuse = fusing(device)
        self.plans_upper_bounds = device_lengths
        self.slot: GraphSlot | None = None  # the planned step's graph rung (None: an eager plan)
        self.kv_dtypes = tuple(dict.fromkeys(kv_dtypes))  # a cache whose layers mix dtypes plans once per dtype
        # a lone request's decode or verify runs as its query rows (`BatchLayout.query_rows`) once its runner has
        # bounded a request's pages (`bound_sequence_pages`; 0: never); a plan may split the KV into as many chunks
        # as FlashInfer runs CTAs in one wave (2 per SM, per KV head) over LONE_ROWS_MAX rows
        self.rows_pages = 0
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        self.split_items = 2 * sms // num_kv_heads
        self.q_dtype = q_dtype
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # by kind of step: other steps (False), steps that run fa2 whatever the cache dtype (True, `fa2`)
        self.eager_wrappers = {fa2: {dtype: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=kernel_backend(dtype, fa2)) for dtype in self.kv_dtypes}
            for fa2 in (False, True)}
        self.wrappers = self.eager_wrappers[False]  # those of the planned step
        # token trees' tree part (see the module's doc); None while the planned step has no query masks
        self.eager_tree_wrappers = {dtype: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2") for dtype in self.kv_dtypes}
        self.tree_wrappers: dict | None = None
        # the eager wrappers' plans write pinned buffers of their own (FlashInfer's), which the plan's copy to the GPU
        # reads when the stream reaches it: the next eager plan waits for the last one's copies (`CopyFence`)
        self.eager_fence = CopyFence(device)
        # (layer, k, v) of the last write_kv since the step's plan: a tree part reads the step's rows from here
        # rather than back from the cache where they are stored as they are (the model's dtype). Reset by every
        # plan: a piecewise graph's attention runs apart from its write, which a replay does not pass through here
        self.written: tuple | None = None
        # the step's write slots as FlashInfer's append kernel reads them (`reserve_write_rows`), by row: 0, 1, ... (each
        # written row a request of its own, and their indptr), pages, offsets, offsets + 1 (their last-page lengths)
        self.append_slots: torch.Tensor | None = None
        self.append_staged = False  # whether they hold the slots of the last `set_write_slots`
        # a lone request's token trees of up to LONE_ROWS_MAX rows run as node rows (`attention/node_rows.py`) once the
        # cache holds their node pages (`use_spare_pages`): [LONE_ROWS_MAX, pages per node], on the device and the host
        self.node_pages: torch.Tensor | None = None
        self.node_pages_host: np.ndarray | None = None
        # the planned node-rows step's copies into its node pages, run by every layer before it attends (None: not
        # such a step); a graph step makes them on the device (`use_device_tree`)
        self.node_copies: NodeRowCopies | None = None
        self.scratch_page = 0  # a graph plan's: where a node-rows step's unused copies are parked
        # an eager plan's kernel calls kept from its first layer's run, by cache dtype (`attention/planned_run.py`; a
        # dtype whose call was not kept maps to None); None after a graph plan, whose steps replay their kernels
        self.planned_runs: dict[torch.dtype, PlannedRun | None] | None = None

    def fa2(self, layout: BatchLayout | None) -> bool:
        """Whether steps of `layout` run the fa2 kernels whatever the cache dtype: every step of a backend of
        `device_lengths` (fa2 kernels read the KV lengths on the device) and every token-tree step, else all
        but a lone request's decode or verify and large prefills (see the module's doc). None: a graph rung of
        no example layout."""
        if self.plans_upper_bounds:
            return True
        if layout is not None and (layout.query_masks is not None or self.lone_rows(layout)):
            return True
        return layout is not None and not lone_decode_or_verify(layout) and not prefill_heavy(layout)

    def bound_sequence_pages(self, pages: int) -> None:
        """The longest request's pages: what a lone rung's query rows are sized by (and what enables them)."""
        self.rows_pages = pages

    def rows_capable(self) -> bool:
        """Whether a lone request's steps may run as query rows: its runner bounds a request's pages, a plan of
        LONE_ROWS_MAX rows fits the work items of one wave, and no sliding window (each row would need the window of
        its own position, which is not tested)."""
        return (self.rows_pages > 0 and self.split_items >= LONE_ROWS_MAX and not self.plans_upper_bounds
                and self.window_left < 0)

    def lone_rows(self, layout: BatchLayout | None) -> bool:
        """Whether `layout`, a lone request's decode or verify, runs as its query rows over KV chunks sized by
        its expected length (`BatchLayout.query_rows`, `rows_split_pages`)."""
        return (self.rows_capable() and layout is not None and lone_decode_or_verify(layout) and layout.causal
                and layout.query_masks is None and int(layout.q_lens[0]) <= LONE_ROWS_MAX)

    def node_rows(self, layout: BatchLayout | None) -> bool:
        """Whether `layout`, a lone request's token tree of at most LONE_ROWS_MAX rows, runs as node rows (one query
        row per node over a KV of its own, `attention/node_rows.py`): the bits of a decode at every node."""
        return (self.node_pages is not None and layout is not None and layout.query_masks is not None
                and lone_decode_or_verify(layout) and int(layout.q_lens[0]) <= len(self.node_pages))

    def spare_pages_wanted(self, page_size: int) -> int:
        """Node pages for a lone request's trees of up to LONE_ROWS_MAX rows, where its steps run as query rows."""
        return LONE_ROWS_MAX * node_pages_per_row(page_size, LONE_ROWS_MAX) if self.rows_capable() else 0

    def exact_tree_rows(self) -> int:
        return LONE_ROWS_MAX if self.rows_capable() else 0

    def use_spare_pages(self, pages: list[int]) -> None:
        self.node_pages_host = np.asarray(pages, dtype=np.int32).reshape(LONE_ROWS_MAX, -1)
        self.node_pages = torch.from_numpy(self.node_pages_host.astype(np.int64)).to(self.device)

    def one_piece(self, layout: BatchLayout | None) -> bool:
        """Whether the steps of `layout` keep each request's KV in one piece (no split-KV): every step of a backend
        of `device_lengths`, and the decodes or verifies of at least ONE_PIECE_MIN_BATCH requests."""
        if self.plans_upper_bounds:
            return True
        return (layout is not None and layout.batch_size >= ONE_PIECE_MIN_BATCH and layout.query_masks is None
                and not layout.prompts and not prefill_heavy(layout))

    def graph_fits(self, slot: GraphSlot, kv_lens: Callable[[], np.ndarray], expected_kv_len: int = 0) -> bool:
        """A one-piece rung declines lengths that its KV in one piece does not suit (`one_piece_suits`); a node-rows
        rung, a tree where a KV chunk boundary falls between its shallowest and its deepest node (its plan, made for
        the deepest, would not serve the others: `chunks_agree`)."""
        if slot.node_rows:
            kv = int(kv_lens()[0])
            split = split_pages_for(expected_kv_len, kv, slot.page_size, self.split_items)
            return chunks_agree(kv - slot.rows, slot.rows, slot.page_size, split)
        return not slot.one_piece or self.one_piece_suits(kv_lens())

    def one_piece_suits(self, kv_lens) -> bool:
        """Whether a step of these KV lengths may keep each request's KV in one piece: always where plans are made for
        upper bounds (the lengths are only known on the device), else where they are even (`even_lengths`)."""
        return self.plans_upper_bounds or even_lengths(kv_lens)

    def rows_split_pages(self, layout: BatchLayout) -> int:
        """Pages per KV chunk of a lone request's query rows (`split_pages_for`)."""
        return split_pages_for(layout.expected_kv_len, int(layout.kv_lens[0]), layout.page_size, self.split_items)

    def tree_split_pages(self, layout: BatchLayout) -> int | None:
        """Pages per KV chunk of a lone request's token-tree context: those of its query rows (`rows_split_pages`), so
        that its plan changes only when the context gains a chunk and a graph rung keeps it in between, as a lone
        rung keeps its rows' (`kv_split`). At least two chunks: FlashInfer merges chunks only where a plan of fixed
        chunks has more than one, and a graph captured with merges must always get them (a plan of its own chunk
        size always merges). None (that plan) for a context of one page, for more than one request, and for a tree
        whose query tiles times those chunks could exceed the work items a graph's plan has room for."""
        if self.rows_pages == 0 or layout.batch_size != 1 or self.plans_upper_bounds:
            return None
        # the most query tiles (FlashInfer's fa2 tiles hold 64 or 128 rows of queries times heads per KV head) and KV
        # chunks (the rows' chunk count, rounded up) a step of this tree may have
        tiles = -(-int(layout.q_lens[0]) * (self.num_qo_heads // self.num_kv_heads) // 64)
        if tiles * (self.split_items // LONE_ROWS_MAX + 1) > self.split_items:
            return None
        context_pages = -(-(int(layout.kv_lens[0]) - int(layout.new_kv_lens[0])) // layout.page_size)
        split = min(self.rows_split_pages(layout), context_pages - 1)
        return split if split > 0 else None

    def _planned(self, layout: BatchLayout, padding_page: int, depths: np.ndarray | None = None
                 ) -> tuple[BatchLayout, dict]:
        """What the paged wrappers attend over for `layout` (a lone tree's node rows, for its nodes' `depths` or else
        all at the deepest node's length; a tree's context part; a lone request's query rows; else the layout itself)
        and the plan's extra arguments."""
        if self.node_rows(layout):
            split, q = self.rows_split_pages(layout), int(layout.q_lens[0])
            if depths is None:  # a chain's own depths where the host knows them, else every node at the deepest
                depths = np.arange(q) if layout.chain_masks else np.full(q, q - 1)
            return (node_rows_layout(layout, depths, split, padding_page, self.node_pages_host),
                    dict(fixed_split_size=split, uniform_q_len=None))
        if layout.query_masks is not None:
            split = self.tree_split_pages(layout)
            return layout.tree_context(), dict(fixed_split_size=split) if split else {}
        if self.lone_rows(layout):
            split = self.rows_split_pages(layout)
            return layout.query_rows(split, padding_page), dict(fixed_split_size=split, uniform_q_len=None)
        return layout, {}

    def plan(self, layout: BatchLayout, write_slots: bool = True) -> None:
        """An eager step of any layout; write_slots=False leaves the write slots to the caller."""
        self.layout, self.slot, self.written, self.planned_runs = layout, None, None, {}
        requests, positions = layout.new_kv_rows() if write_slots else (np.zeros(0, np.int32),) * 2
        kv_indptr = layout.kv_indptr()
        nodes = self.node_rows(layout)
        tree = layout.query_masks is not None and not nodes
        # node rows planned for each node's own length: the tree's depths read back (an eager step, not on the path of
        # graph steps)
        depths = (layout.query_masks[0].sum(dim=1) - 1).cpu().numpy() if nodes and not layout.chain_masks else None
        # what the paged wrappers attend over (padding rows, if any, read the request's first page: never used)
        padding_page = int(layout.kv_indices[0]) if len(layout.kv_indices) else 0
        planned, extra = self._planned(layout, padding_page, depths)
        separate = planned is not layout
        n_idx, b, n_new, n_planned = len(layout.kv_indices), layout.batch_size, len(requests), len(planned.kv_indices)
        # one host-to-device copy for everything the kernels read on the GPU
        gpu = upload(np.concatenate([layout.kv_indices, kv_indptr, requests, positions]
                                    + ([planned.kv_indices] if separate else [])), self.device)
        self.kv_indices, self.kv_indptr, requests_gpu, positions_gpu, planned_indices = gpu.split(
            [n_idx, b + 1, n_new, n_new, n_planned if separate else 0])
        if write_slots:
            self.set_write_slots(*slots_on_device(self.kv_indices, self.kv_indptr, requests_gpu, positions_gpu,
                                                  layout.page_size))
        self.wrappers = self.eager_wrappers[self.fa2(layout)]
        one_piece = self.one_piece(layout) and self.one_piece_suits(layout.kv_lens)
        self.eager_fence.wait()
        self._plan_wrappers(planned, pinned(planned.qo_indptr()), pinned(planned.kv_indptr()),
                            planned_indices if separate else self.kv_indices, pinned(planned.last_page_lens()),
                            pinned(planned.kv_lens), one_piece=one_piece, **extra)
        self.tree_wrappers = self._plan_trees(self.eager_tree_wrappers, layout, pinned(layout.qo_indptr())) if tree \
            else None
        self.eager_fence.mark()
        self.node_copies = self._node_copies(layout, padding_page) if nodes else None

    def _node_copies(self, layout: BatchLayout, parking_page: int) -> NodeRowCopies:
        """An eager node-rows step's copies into its node pages (unused ones parked on `parking_page`, which no node
        page is). Not fused: a first eager step would compile them mid-run."""
        context = upload(np.int64([layout.kv_lens[0] - layout.q_lens[0]]), self.device)
        return NodeRowCopies(layout.query_masks[0], context, self.kv_indices, self.node_pages, layout.page_size,
                             parking_page)

    def graph_slot(self, batch_size: int, max_pages: int, example: BatchLayout | None = None) -> GraphSlot:
        """The buffers and wrappers of one rung; `example` (a layout of the steps it will replay, padded to
        its size) picks the kernel its graph is captured with, and a token-tree rung's tree size."""
        nodes, tree, rows = self._step_kind(example)
        return GraphSlot(self, batch_size, max_pages, self.fa2(example),
                         tree_size=int(example.q_lens.max()) if tree else 0, rows=rows,
                         one_piece=self.one_piece(example), node_rows=nodes,
                         page_size=example.page_size if nodes else 0)

    def _step_kind(self, layout: BatchLayout | None) -> tuple[bool, bool, int]:
        """How a step of `layout` attends, which a graph rung is captured for and replays only: (its rows are a lone
        request's tree's node rows, they are trees as a context and a tree part, a lone request's query rows: their
        count or 0)."""
        nodes = self.node_rows(layout)
        tree = layout is not None and layout.query_masks is not None and not nodes
        rows = int(layout.q_lens[0]) if self.lone_rows(layout) or nodes else 0
        return nodes, tree, rows

    def plan_graph(self, slot: GraphSlot, layout: BatchLayout, scratch_page: int) -> None:
        """A graph replay: `layout` padded to the slot's batch size goes into the slot's buffers. The
        captured graph computes its own write slots from them (see `slots_on_device`)."""
        layout = layout.padded(slot.batch_size, scratch_page)
        self.layout, self.written, self.node_copies, self.scratch_page = layout, None, None, scratch_page
        self.planned_runs = None
        nodes, tree, rows = self._step_kind(layout)
        if (self.fa2(layout) != slot.fa2 or tree != slot.tree or rows != slot.rows or nodes != slot.node_rows
                or self.one_piece(layout) != slot.one_piece):
            kind = ("token trees" if slot.tree else f"a tree of {slot.rows} node rows" if slot.node_rows else
                    f"{slot.rows} query rows" if slot.rows else "the fa2 kernels" if slot.fa2 else "other kernels")
            raise ValueError(f"a rung captured for {kind} cannot replay this layout "
                             f"(q_lens {layout.q_lens.tolist()}, masks: {tree})")
        if tree and int(layout.q_lens.max()) > slot.tree_size:
            raise ValueError(f"a token-tree step of {int(layout.q_lens.max())} tokens per request exceeds the "
                             f"trees its rung of {slot.batch_size} was made for")
        self.wrappers, self.slot = slot.wrappers, slot
        self.kv_indices, self.kv_indptr = slot.kv_indices, slot.kv_indptr
        planned, extra = self._planned(layout, scratch_page)
        slot.host_fence.wait()
        if planned is not layout:  # the step's own page metadata, for its write slots and K/V moves
            slot.step_index.stage("kv_indptr", layout.kv_indptr())
            slot.step_index.stage("kv_indices", layout.kv_indices)
            slot.step_index.send()
        index = slot.index
        qo_indptr, kv_indptr, last_page_len = (index.stage("qo_indptr", planned.qo_indptr()),
                                                index.stage("kv_indptr", planned.kv_indptr()),
                                                index.stage("last_page_len", planned.last_page_lens()))
        if nodes:  # the tokens before the step, and the tree's masks: what the step's nodes' real metadata comes from
            index.stage("context", np.int32([layout.kv_lens[0] - layout.q_lens[0]]))
            slot.node_masks.copy_(layout.query_masks[0], non_blocking=True)
        index.stage("kv_indices", planned.kv_indices)
        index.send()
        # a rung planned with fixed KV chunks (a lone request's query rows or tree) whose requests have the chunks of
        # its last plan, or a one-piece rung of the same query counts, keeps that plan: its kernels read only the page
        # metadata just sent
        fixed = extra.get("fixed_split_size")
        split = (kv_split(planned, fixed) if fixed else
                 planned.qo_indptr().astype(np.int32).tobytes() if slot.one_piece else None)
        if split is None or split != slot.split:
            kv_lens = slot.kv_lens[:planned.batch_size]
            kv_lens.numpy()[:] = planned.kv_lens
            self._plan_wrappers(planned, qo_indptr, kv_indptr, slot.planned[1][:len(planned.kv_indices)],
                                last_page_len, kv_lens, one_piece=slot.one_piece,
                                **{"uniform_q_len": int(layout.q_lens[0]), **extra})
            slot.split = split
        # the tree part's indptr: the context's qo_indptr (the same queries), staged above
        self.tree_wrappers = self._plan_trees(slot.tree_wrappers, layout, qo_indptr, slot) if tree else None
        slot.host_fence.mark()

    def use_device_tree(self) -> None:
        """A node-rows rung, planned with every node at the deepest node's length: each node's real page metadata
        (its depth from the masks) into the rung's buffers, and the step's copies into the node pages."""
        slot = self.slot
        if slot is None or not slot.node_rows:
            return
        context = slot.index["context"].long()
        # the copies read the planned buffers' request pages (`slot.kv_indices`, the step's own), not the ones
        # rewritten below
        self.node_copies = NodeRowCopies(slot.node_masks, context, slot.kv_indices, self.node_pages,
                                         self.layout.page_size, self.scratch_page, fuse=self.fuse)
        write = fused_if(write_node_row_metadata, self.fuse)
        kv_indptr, kv_indices, last_page_len = slot.planned
        write(kv_indptr, last_page_len, kv_indices, context, self.node_copies.depths, self.layout.page_size)

    def rows_plan_serves(self, slot: GraphSlot, q: int, kv_lens: tuple[int, int], expected_kv_len: int,
                         page_size: int) -> bool:
        """A query-rows rung of q rows planned at the longer length serves every length down to the shorter one where
        each row has as many KV chunks at both (`kv_split`: the plan's work depends on nothing else); a row's chunk
        count grows with the length, so the two ends decide it."""
        if slot.rows != q or slot.node_rows or not self.rows_capable():
            return False
        splits = {split_pages_for(expected_kv_len, kv, page_size, self.split_items) for kv in kv_lens}
        return len(splits) == 1 and len({rows_chunks(kv, q, page_size, *splits) for kv in kv_lens}) == 1

    def use_device_rows(self, kv_len: torch.Tensor) -> None:
        slot = self.slot
        if slot is None or not slot.rows or slot.node_rows:
            return
        kv_indptr, kv_indices, last_page_len = slot.planned
        write = fused_if(write_query_row_metadata, self.fuse)
        write(kv_indptr, last_page_len, kv_indices, kv_len, slot.rows, self.layout.page_size)

    def lengths_plan_serves(self, slot: GraphSlot) -> bool:
        """A backend planning for upper bounds (`device_lengths`), or a rung that keeps each request's KV in one piece:
        its plan depends on the query counts alone (a batch's verify queued ahead, `TargetRunner.run_block_ahead`)."""
        return self.plans_upper_bounds or slot.one_piece

    def use_device_lengths(self, kv_lens: torch.Tensor) -> None:
        """A graph rung whose plan serves lengths below those it was made for (`lengths_plan_serves`): its page
        metadata becomes the real lengths' (each request keeps its first pages up to min(real, planned) length), on
        the device, with no host work. Captured in the step's graph; with exact lengths it rewrites what is already
        there."""
        slot = self.slot
        if slot is None or not self.lengths_plan_serves(slot):
            return
        write_real_page_metadata(slot.kv_indptr, slot.last_page_len, slot.kv_indices, kv_lens, self.layout.page_size)

    def _plan_wrappers(self, layout: BatchLayout, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                       kv_indices_gpu: torch.Tensor, last_page_len: torch.Tensor, kv_lens: torch.Tensor,
                       uniform_q_len: int | None = None, fixed_split_size: int | None = None,
                       one_piece: bool = False) -> None:
        # indptr, last_page_len and kv_lens are pinned CPU tensors: plan reads them on the host, and its
        # copies of them to the GPU stay asynchronous. The KV lengths and both maxima are handed over
        # because the layout already knows them: plan would otherwise derive them from the indptrs with a
        # dozen small host tensor ops per wrapper (a plan is ~0.25 ms of host time on the step's path).
        lengths = dict(seq_lens=kv_lens, max_token_per_sequence=int(layout.q_lens.max()),
                       max_sequence_kv=int(layout.kv_lens.max()))
        for kv_dtype, wrapper in self.wrappers.items():
            wrapper.plan(qo_indptr, kv_indptr, kv_indices_gpu, last_page_len, self.num_qo_heads, self.num_kv_heads,
                         self.head_dim, layout.page_size, causal=layout.causal, sm_scale=self.sm_scale,
                         q_data_type=self.q_dtype, kv_data_type=kv_dtype, non_blocking=True,
                         uniform_q_len=uniform_q_len, disable_split_kv=one_piece,
                         fixed_split_size=fixed_split_size,
                         window_left=self.window_left, **lengths)

    def _plan_trees(self, wrappers: dict, layout: BatchLayout, indptr: torch.Tensor,
                    slot: GraphSlot | None = None) -> dict:
        """The tree part of a token-tree step: every request's new rows against its new rows (each request the
        same size), under the query masks, packed on the device. `indptr`: the requests' row offsets, pinned.
        A graph rung already planned for this tree size keeps its plan: the masks go into its mask buffer."""
        masks = layout.packed_tree_masks()
        size = int(layout.q_lens[0])
        if slot is not None and slot.tree_planned == size:
            slot.tree_masks[:len(masks)].copy_(masks)
            return wrappers
        for kv_dtype, wrapper in wrappers.items():
            wrapper.plan(indptr, indptr, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                         packed_custom_mask=masks, sm_scale=self.sm_scale, q_data_type=self.q_dtype,
                         kv_data_type=kv_dtype, non_blocking=True, uniform_q_len=size, disable_split_kv=True)
        if slot is not None:
            slot.tree_planned = size
        return wrappers

    def reserve_write_rows(self, rows: int) -> None:
        """Room for the most K/V rows a step writes, so that layers stored in the model's dtype are written by
        FlashInfer's append kernel: one launch that copies, where the indexed copy of `LayerKV.write`
        took 3.3-4.8 us a layer against its 1.9-2.6 (n = 1 to 1,024 rows, an H200, BENCHMARKS.md). The kernel finds
        a row's slot through page metadata: each row is made a request of one page (its slot's) holding the row's
        offset, so the slots need only be copied to int32 once per step, by the step's first write."""
        self.append_slots = torch.zeros(4, rows + 1, dtype=torch.int32, device=self.device)
        self.append_slots[0] = torch.arange(rows + 1, dtype=torch.int32, device=self.device)  # rows, and indptr

    def set_write_slots(self, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        super().set_write_slots(pages, offsets)
        self.append_staged = False

    def write_kv(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = k.shape[0]
        slots = self.append_slots
        if slots is None or layer.data.dtype != k.dtype or rows >= slots.shape[1]:  # FP8 layers quantize first
            layer.write(self.write_pages, self.write_offsets, k, v)
        else:
            if not self.append_staged:  # pages, offsets, and a one-page request's last-page length: offset + 1
                slots[1, :rows].copy_(self.write_pages[:rows])
                slots[2, :rows].copy_(self.write_offsets[:rows])
                torch.add(slots[2, :rows], 1, out=slots[3, :rows])
                self.append_staged = True
            flashinfer.append_paged_kv_cache(k, v, slots[0, :rows], slots[2, :rows], layer.data, slots[1, :rows],
                                             slots[0, :rows + 1], slots[3, :rows])
        self.written = (layer, k, v)

    def attend(self, q: torch.Tensor, layer: LayerKV, out: torch.Tensor | None = None) -> torch.Tensor:
        dtype = layer.data.dtype
        scales = dict(k_scale=layer.k_scale, v_scale=layer.v_scale) if layer.is_fp8 else {}
        if out is None:  # FlashInfer would zero the output it allocates: a kernel per layer, and every row is written
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.node_copies is not None:  # node rows: each node's context tail and path into its node pages first
            self.node_copies.copy(layer)
        if self.tree_wrappers is None:
            if self.planned_runs is None or scales:
                return self.wrappers[dtype].run(q, layer.data, out=out, **scales)
            if dtype not in self.planned_runs:  # the plan's first layer of this dtype: its call kept for the others
                out, self.planned_runs[dtype] = PlannedRun.record(self.wrappers[dtype], q, layer.data, out)
                return out
            planned = self.planned_runs[dtype]
            if planned is None:  # its first run's call was not one to keep
                return self.wrappers[dtype].run(q, layer.data, out=out)
            return planned(q, layer.data, out)
        # a token tree: the context part, then the tree part over the step's rows as stored, merged into the first
        out, lse = self.wrappers[dtype].run(q, layer.data, out=out, return_lse=True, **scales)
        rows = q.shape[0]
        written_layer, k, v = self.written or (None, None, None)
        if written_layer is not layer or layer.is_fp8 or k.dtype != dtype:
            stored = layer.stored(self.write_pages[:rows], self.write_offsets[:rows])
            k, v = stored[:, 0], stored[:, 1]
        tree_out, tree_lse = self.tree_wrappers[dtype].run(q, k[:rows], v[:rows], return_lse=True, **scales)
        flashinfer.merge_state_in_place(out, lse, tree_out, tree_lse)
        return out


def kernel_backend(kv_dtype: torch.dtype, fa2: bool = False) -> str:
    """fa2 for FP8 caches (fa3 needs FP8 queries) and the steps that run fa2 whatever the dtype
    (`FlashInferBackend.fa2`), "auto" (fa3 on Hopper) otherwise."""
    return "fa2" if kv_dtype == FP8_DTYPE or fa2 else "auto"


def split_pages_for(expected_kv_len: int, kv_len: int, page_size: int, split_items: int) -> int:
    """Pages per KV chunk of a lone request's query rows: its length at most (and the largest verify past it) in as
    many chunks as a plan of LONE_ROWS_MAX rows may run in one wave (`split_items` work items). The same at every
    step of the request, whatever its queries; a request of unknown length gets its current length's. A verify near
    the end of a request runs rows past its length (up to LONE_ROWS_MAX - 1 of them): its chunks stay the request's,
    as its rows within the length must have the bits of the decodes there."""
    longest = expected_kv_len if expected_kv_len else kv_len
    pages = -(-max(longest + LONE_ROWS_MAX, kv_len) // page_size)
    return -(-pages // (split_items // LONE_ROWS_MAX))


def rows_chunks(kv_len: int, q: int, page_size: int, split_pages: int) -> tuple[int, ...]:
    """The KV chunks of each of a lone request's q query rows at KV length `kv_len` (`BatchLayout.query_rows`)."""
    pages = -(-(kv_len - q + 1 + np.arange(q)) // page_size)
    return tuple((-(-pages // split_pages)).tolist())


def kv_split(layout: BatchLayout, split_pages: int) -> bytes:
    """What FlashInfer's plan of `layout` with KV chunks of `split_pages` pages derives everything its kernels read
    from the plan from (work items, partial-result offsets, merges): the query counts and each request's number
    of chunks. The kernels take the KV lengths from the page metadata when they run, and count a request's chunks
    from its length as the plan did, so a step of the same split can replay the last plan with its own metadata."""
    chunks = -(-np.diff(layout.kv_indptr()) // split_pages)
    return b"".join(a.astype(np.int32).tobytes() for a in (layout.qo_indptr(), chunks, np.int32([split_pages])))


# the most queries of a lone request's step that run as query rows (a chain verify of the block)
LONE_ROWS_MAX = 16
# the fewest requests whose decodes or verifies keep each request's KV in one piece (see the module's doc): on an
# H200 such a step has at least 128 (request, KV head) work items for 132 SMs
ONE_PIECE_MIN_BATCH = 64
# the most tokens a request's KV may run past the batch's mean in a step that keeps it in one piece: one CTA walks
# ~15 ns a token per layer there (a lone fa3 decode at 6k context: 85 us), so such an excess adds ~1 ms to a step of
# the default target, about what running the step as a mixed step instead costs the host
ONE_PIECE_MAX_EXCESS = 2048


def even_lengths(kv_lens) -> bool:
    """Whether no request's KV is more than ONE_PIECE_MAX_EXCESS tokens longer than the batch's mean."""
    kv_lens = np.asarray(kv_lens)
    return float(kv_lens.max()) - float(kv_lens.mean()) <= ONE_PIECE_MAX_EXCESS


def lone_decode_or_verify(layout: BatchLayout) -> bool:
    """One request and no prompt chunk: its decode, or the verify of its drafts."""
    return layout.batch_size == 1 and not layout.prompts


# fa3's query tiles fill an H200 from about this many query rows in all, at this many per request on average
PREFILL_FA3_MIN_QUERIES = 512
PREFILL_FA3_MIN_MEAN_QUERIES = 64


def prefill_heavy(layout: BatchLayout) -> bool:
    """A step of enough query rows, per request and in all, for fa3 to be the faster kernel: large prefills."""
    queries = layout.num_queries
    return queries >= PREFILL_FA3_MIN_QUERIES and queries >= PREFILL_FA3_MIN_MEAN_QUERIES * layout.batch_size

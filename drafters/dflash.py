"""DFlash drafting over a paged context cache, with CUDA graphs for the draft step.

Per request the drafter keeps a context cache (per draft layer, the K/V of the projected target
features of every committed position whose features are known). The prompt's context is written
chunk by chunk as the target prefills it (`add_context`: a token step of any length, captured piecewise
over token counts like the target's mixed steps). After a verify, the a + 1 committed positions'
features are rows of the target's verify features (`extend` records which rows); the next draft step
writes them. A plain step's rows (`add_step_context`: one per running request, and the prompt chunks riding
along) are copied aside and written with the rows of the plain steps after it, before the next draft, in one
token step.

A draft step has a fixed shape, so it is captured as CUDA graphs over the batch ladder:

    context rows   block_size per request: the first n_i are the new context (positions
                   start_i - n_i .. start_i - 1), the rest padding written to the scratch page
    block rows     [anchor, MASK x (b-1)] at positions start_i .. start_i + b - 1: the whole block, or a
                   shorter one for a step scoring fewer drafts (`block_rows`, below)
    attention      block queries, non-causal over the request's whole cache (one plan for all layers)

then the block's scratch slots are released, so the cache ends at start_i (the anchor's position),
holding exactly the context positions 0 .. start_i - 1. Padding the context to block_size (a verify
commits at most block_size positions) is what makes the shape fixed.

A step that scores n < bs - 1 drafts runs the shortest block the drafter was trained for that holds n + 1
positions (`DFlashSpec.block_for`; as DFlash's reference implementation runs blocks shorter than the trained one):
under load, where `auto` verifies chains of 2-4, the block's rows are most of the draft step's work (at 64 requests
and 3 drafts, 64 x 16 block rows through the draft layers against 64 x 4). A drafter trained on whole blocks alone
(the shipped one) drafts much worse from shorter ones (math, chains of 4: first-draft acceptance 0.35 against 0.91,
BENCHMARKS.md), so it always runs whole blocks.

Drafting ahead (`propose_next`): the step after a verify is queued before the verify's acceptance reaches
the host. Its starts, counts and anchors come from the acceptance on the device, and its attention is
planned for the upper bound (all q verified positions accepted): the draft step itself writes the real
lengths' page metadata into its graph rung (`use_device_lengths`; this drafter's backend runs fa2, whose
kernels read the lengths on the device). `settle` then trims each context to its committed positions.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from attention.batch_layout import BatchLayout, slots_on_device
from attention.page_pool import PagePool, PageTable, grow_tables, pool_holds, table_lengths
from attention.transfer import upload
from attention.zero_pages import zeroed
from drafters.dflash_model import DFlashDraftModel
from drafters.token_ranking import draft_vocabulary
from specdec.engine.drafter import DraftContext, Drafter, DraftRequest
from specdec.models.logprobs import log_normalizer
from specdec.runtime.cuda_graphs import StaticInputs
from specdec.runtime.model_runner import FixedStep, ModelRunner, TokenStep

DRAFT_STEP = "draft"  # the fixed-shape step; its graph ladders' keys are (DRAFT_STEP, drafts scored per request)
CANDIDATES_STEP = "draft with candidates"  # the same step also giving each position's top k (token trees)
CONTEXT_STEP = "context"  # prompt chunks' context K/V (any token count)
HELD_STEP = "held context"  # plain steps' context K/V, from the rows held aside
# plain steps' context rows held before they are written (at least one step's): each write is ~15 small kernels
# whatever its rows, which took 0.1-0.15 ms of a 3.3 ms plain step at 256 requests on an H200, so one write per
# 2048 rows (8 steps at 256 requests; 19 MB of features for the default target) costs a fraction of one per step
HELD_ROWS = 2048


class DFlashDrafter(ModelRunner, Drafter):
    proposes_candidates = True
    proposes_confidence = True

    def __init__(self, model: DFlashDraftModel, token_ranking: np.ndarray | None = None):
        self.model = model
        self.token_ranking = token_ranking  # its tokens, most frequent first (drafters/token_ranking.py; None: none)
        self.block_size = model.spec.block_size
        self.target_layer_ids = model.spec.target_layer_ids
        self.mask_token_id = model.spec.mask_token_id
        self.draft_window = model.spec.draft_window
        self.tables: dict[int, PageTable] = {}
        self.pending: dict[int, tuple[int, int]] = {}  # request id -> (row in the verify features, count)
        self.queued: dict[int, int] = {}  # request id -> its row of `drafts_out` drafted ahead (`propose_next`)
        self.queued_drafts = 0  # how many drafts per request the queued rows hold
        self.queued_candidates = False  # whether the queued step also gave each position's top k (token trees)
        self.unsettled: dict[int, int] = {}  # request id -> its verified anchor's position, until `settle`
        self.held_tables: list[PageTable] = []  # the table of each held row (`add_step_context`), in order
        self.held_steps: list[int] = []  # the rows each plain step held, in order
        self.held_chunks = False  # whether a held step's rows carried prompt chunks (not one row per request)
        self.dropped: set[PageTable] = set()  # tables released while rows of theirs were held: not written

    # ---- setup -------------------------------------------------------------------------------
    def attach(self, context: DraftContext) -> None:
        bs = self.block_size
        self.context = context
        # the runner is set up here, not at load time: device, page size and KV dtype are the engine's
        ModelRunner.__init__(self, self.model, backend_name=context.backend_name, kv_dtype=context.kv_dtype,
                             q_dtype=context.dtype, page_size=context.page_size, max_batch=context.max_batch,
                             device=context.device, device_lengths=True,
                             window_left=context.window if context.window > 0 else -1)
        # block positions run up to the target's context plus one block
        self.model.rotary.max_positions = context.max_context + bs
        batch = context.max_batch
        self.inputs = StaticInputs({"anchors": batch, "starts": batch, "counts": batch, "rows": batch}, self.device)
        self.drafts_out = torch.zeros(batch, bs - 1, dtype=torch.long, device=self.device)
        # the draft lengths steps ask for, each a step of its own: scoring a draft is a row of the output layer
        # over the whole vocabulary, the largest part of a draft step under load
        self.draft_lengths = tuple(sorted({n for n in context.draft_lengths if 1 <= n < bs} | {bs - 1}))
        k = context.candidates  # token trees: each position's top k (log-probabilities, tokens)
        self.candidates_out = (torch.zeros(batch, bs - 1, k, dtype=torch.float32, device=self.device),
                               torch.zeros(batch, bs - 1, k, dtype=torch.long, device=self.device)) if k else None
        # budget steps: each draft's own log-probability, which shares out their verify rows (row_budget.py)
        self.confidence_out = (torch.zeros(batch, bs - 1, dtype=torch.float32, device=self.device)
                               if context.confidence else None)
        self.confidence: torch.Tensor | None = None  # the last `propose`'s, in its requests' order
        self.arange = torch.arange(max(batch, bs), device=self.device)
        self._draft_head(context)
        # a prompt chunk's context rows: at most the target's features buffer; plain steps' held rows: HELD_ROWS
        features = context.features
        self.held_features = zeroed((max(HELD_ROWS, batch), features.shape[1]), features.dtype, self.device)
        held = self.held_features.shape[0]
        rows = max(features.shape[0], held)
        self.context_inputs = StaticInputs({name: rows for name in ("rows", "positions", "pages", "offsets")},
                                           self.device)
        self.context_step = TokenStep(CONTEXT_STEP, "drafter context", features.shape[0], self.context_inputs,
                                      lambda size, cut: self._context_body(size, features))
        self.held_step = TokenStep(HELD_STEP, "drafter context, held rows", held, self.context_inputs,
                                   lambda size, cut: self._context_body(size, self.held_features))
        # the most K/V rows a step writes: a draft step's context and block rows, or a context step's rows
        self.attn.reserve_write_rows(max(2 * bs * batch, rows))

    def _draft_head(self, context: DraftContext) -> None:
        """The output layer a draft step scores with: the target's, or its rows of the `draft_vocab` most frequent
        tokens of the drafter's ranking (a copy: a draft then reads draft_vocab / vocabulary of the layer's weights),
        whose ids `draft_ids` maps the scores' columns back to."""
        lm_head = context.lm_head
        ids = draft_vocabulary(self.token_ranking, context.draft_vocab, lm_head.weight.shape[0])
        self.head, self.draft_ids = lm_head, None
        if ids is None:
            return
        if len(ids) < max(context.candidates, 1):  # token trees take each position's top `candidates` drafts
            raise ValueError(f"draft_vocab {context.draft_vocab} leaves {len(ids)} tokens to draft from, fewer than "
                             f"the {context.candidates} candidates per position token trees take: use draft_vocab >= "
                             f"{context.candidates}, or 0 for the whole vocabulary")
        self.draft_ids = torch.from_numpy(ids).to(self.device)
        weight = lm_head.weight.detach().index_select(0, self.draft_ids)
        bias = getattr(lm_head, "bias", None)
        self.head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=self.device,
                              dtype=weight.dtype).requires_grad_(False)
        self.head.weight.copy_(weight)
        if bias is not None:
            self.head.bias.copy_(bias.detach().index_select(0, self.draft_ids))

    def _token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of columns of the draft head's scores."""
        return index if self.draft_ids is None else self.draft_ids[index]

    def allocate_cache(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages, self.page_size)
        self.allocate_kv(num_pages, self.context.calibrate_fp8_scales)

    def fixed_steps(self) -> list[FixedStep]:
        bs = self.block_size

        def dummy(block: int):  # a padding request writes block_size context rows and `block` block rows
            return lambda batch, scratch: BatchLayout.dummy(batch, block, block, self.page_size, scratch, causal=False)

        def draft_step(n: int) -> FixedStep:
            block = self.block_rows(n)
            return FixedStep((DRAFT_STEP, n), f"draft of {n}", dummy(block), bs + block,
                             lambda batch: self._draft_body(batch, length=n))

        steps = [draft_step(n) for n in self.draft_lengths]
        if self.candidates_out is not None:  # only the steps that feed a token tree pay for the top k
            steps.append(FixedStep(CANDIDATES_STEP, CANDIDATES_STEP, dummy(bs), 2 * bs,
                                   lambda batch: self._draft_body(batch, candidates=True),
                                   max_rung=self.context.candidates_max_batch))
        return steps

    def token_steps(self) -> list[TokenStep]:
        return [self.context_step, self.held_step] if self.attn.supports_graphs else []

    def step_seconds(self, candidates: bool = False, length: int | None = None) -> dict[int, float]:
        return self.replay_seconds(CANDIDATES_STEP if candidates else (DRAFT_STEP, self._length(length)))

    def _length(self, length: int | None) -> int:
        """The shortest draft step that scores at least `length` drafts (None: the whole block)."""
        return next((n for n in self.draft_lengths if length is not None and n >= length), self.block_size - 1)

    def block_rows(self, length: int | None) -> int:
        """Block positions of a draft step scoring `length` drafts (None: a token tree's, the whole block)."""
        return self.block_size if length is None else self.model.spec.block_for(self._length(length))

    @property
    def queued_length(self) -> int | None:
        return self.queued_drafts if self.queued else None

    # ---- lifecycle ---------------------------------------------------------------------------
    @torch.no_grad()
    def add_context(self, requests: list[DraftRequest], features: torch.Tensor, lens: list[int]) -> None:
        """Write the context K/V of each prefill chunk now (positions length .. length + n - 1 of the
        request's context cache; a request's first chunk creates the cache), after the rows held before it (a
        plain step may have held an earlier chunk of the same prompt)."""
        self._write_held()
        first = self._feature_row(features)
        self._write_context(requests, lens, np.arange(first, first + sum(lens)))

    @torch.no_grad()
    def add_step_context(self, requests: list[DraftRequest], features: torch.Tensor,
                         lens: list[int] | None = None) -> None:
        """Held: the rows are copied aside (one copy) and written with later plain steps' before the next draft; a
        step with more rows than the held buffer takes (a long prompt chunk) writes its rows now, after those held."""
        rows, capacity = features.shape[0], self.held_features.shape[0]
        if len(self.held_tables) + rows > capacity:
            self._write_held()
            if rows > capacity:  # written at once, as the base class does
                Drafter.add_step_context(self, requests, features, lens)
                return
        start = len(self.held_tables)
        self.held_features[start:start + rows].copy_(features)
        try:  # a running request has its table (its prompt's context made it): a third of `_table`'s time
            tables = [self.tables[r.request_id] for r in requests]
        except KeyError:  # a prompt's first chunk creates its table
            tables = [self._table(r) for r in requests]
        if lens is not None and rows > len(tables):  # a table listed once per row (`_stage_held`)
            tables = [table for table, n in zip(tables, lens) for _ in range(n)]
            self.held_chunks = True
        self.held_tables += tables
        self.held_steps.append(rows)

    def catch_up(self, requests: list[DraftRequest]) -> None:
        self.queued = {}  # its context rows are written and settled already
        if not self.pending:  # the usual case between plain steps: no request scanned
            return
        pending = [(r, self.pending.pop(r.request_id)) for r in requests if r.request_id in self.pending]
        pending = [(r, row, count) for r, (row, count) in pending if count]
        if pending:
            self._write_held()  # rows held before a request's pending ones are its earlier positions
            self._write_context([r for r, _, _ in pending], [count for _, _, count in pending],
                                np.concatenate([np.arange(row, row + count) for _, row, count in pending]))

    def _write_held(self) -> None:
        """The held rows' context K/V, written now in one token step (the rows of released requests dropped)."""
        tables, self.held_tables = self.held_tables, []
        steps, self.held_steps = self.held_steps, []
        chunks, self.held_chunks = self.held_chunks, False
        dropped, self.dropped = self.dropped, set()
        rows = [i for i, table in enumerate(tables) if table not in dropped] if dropped else range(len(tables))
        if len(rows) < len(tables):
            tables = [tables[i] for i in rows]
        if not tables:
            return
        batch = steps[0] if not chunks and len(rows) == sum(steps) and all(n == steps[0] for n in steps) else 0
        if batch and all(tables[start:start + batch] == tables[:batch] for start in range(batch, len(tables), batch)):
            total = self._stage_repeated(tables[:batch], len(steps))  # the same requests at every held step
        else:
            total = self._stage_held(tables)
        self._run_context(self.held_step, total, rows)

    def _write_context(self, requests: list[DraftRequest], lens: list[int], rows: np.ndarray) -> None:
        """Context K/V of request i's next lens[i] positions from the features at `rows` (sum(lens) of them, request
        by request), written now in one token step."""
        tables = [self._table(r) for r in requests]
        if len(rows) == len(tables):  # one position each (every len is at least 1)
            total = self._stage_one_position_each(tables)
        else:
            ends = []
            for table, n in zip(tables, lens):
                table.grow(n)
                ends.append(table.length)
            layout = BatchLayout.for_tokens(lens, ends, [t.array for t in tables], self.page_size, causal=False)
            total = self.stage_token_rows(self.context_step, layout)
        self._run_context(self.context_step, total, rows)

    def _run_context(self, step: TokenStep, total: int, rows) -> None:
        """Run a context step over its `total` staged positions, their features at `rows` of the step's source."""
        self.context_inputs.fill("rows", rows)
        self.context_inputs.upload()
        self.run_tokens(step, total)

    def _table(self, request: DraftRequest) -> PageTable:
        """The request's context table; its first chunk creates it (not `setdefault`: its default, built for every
        request, cost 85 us of a plain step's host work at 256 requests against 10 for the lookups)."""
        table = self.tables.get(request.request_id)
        if table is None:
            table = self.tables[request.request_id] = PageTable(self.pool)
        return table

    def _stage_one_position_each(self, tables: list[PageTable]) -> int:
        """Stage the next position of each table (each listed once), its K/V page read from the table alone: a step's
        rows write one context row per request, and a layout over every table's pages took 3x the host time (0.26
        against 0.08 ms for 256 requests, host work alone)."""
        places = [t.append() for t in tables]
        positions, pages = (np.array([place[i] for place in places], dtype=np.int64) for i in (0, 1))
        return self.stage_token_places(self.context_step, positions, pages, positions % self.page_size)

    def _stage_held(self, tables: list[PageTable]) -> int:
        """Stage the held rows' positions: a table listed k times (once per plain step) gets its next k positions, in
        the order listed. Each table grows once by its rows, and positions and pages are gathered in numpy: row by
        row (`_stage_one_position_each` over the repeated list) took 0.88 ms for the 2048 rows of 256 requests."""
        ids = np.fromiter(map(id, tables), dtype=np.int64, count=len(tables))
        _, first, groups, counts = np.unique(ids, return_index=True, return_inverse=True, return_counts=True)
        unique = [tables[i] for i in first.tolist()]
        order = np.argsort(groups, kind="stable")  # each table's rows together, in the order listed
        rank = np.empty(len(tables), dtype=np.int64)
        rank[order] = np.arange(len(tables)) - (np.cumsum(counts) - counts)[groups[order]]
        positions = table_lengths(unique)[groups] + rank
        grow_tables(unique, counts.tolist())
        page_starts = np.cumsum([0] + [t.num_pages for t in unique[:-1]])
        pages = np.concatenate([t.array for t in unique])[page_starts[groups] + positions // self.page_size]
        return self.stage_token_places(self.context_step, positions, pages, positions % self.page_size)

    def _stage_repeated(self, tables: list[PageTable], steps: int) -> int:
        """`_stage_held` for rows held by `steps` plain steps of the same requests (`tables`, each once, in the same order
        at every step): row j * len(tables) + i is position length_i + j of table i. The usual case under load, staged
        without sorting the rows by table and with one call to the pool: the 2048 rows of 256 requests in 0.37-0.44 ms
        of an H200 machine's host time against 1.04-1.15 ms (BENCHMARKS.md)."""
        n = len(tables)
        lengths = table_lengths(tables)
        grow_tables(tables, [steps] * n)
        positions = (lengths + np.arange(steps)[:, None]).reshape(-1)
        arrays = [t.array for t in tables]
        sizes = np.fromiter(map(len, arrays), dtype=np.int64, count=n)
        pages = np.concatenate(arrays)[np.tile(np.cumsum(sizes) - sizes, steps) + positions // self.page_size]
        return self.stage_token_places(self.context_step, positions, pages, positions % self.page_size)

    def _feature_row(self, features: torch.Tensor) -> int:
        """The row of the features buffer given at attach where `features` (a run of its rows) starts."""
        base = self.context.features
        row_bytes = base.stride(0) * base.element_size()
        offset = features.data_ptr() - base.data_ptr()
        if (features.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or offset % row_bytes
                or features.stride() != base.stride()):
            raise ValueError("DFlash reads the prefill features from the buffer given at attach")
        return offset // row_bytes

    def _context_body(self, size: int, source: torch.Tensor) -> None:
        """Context K/V of `size` staged rows: the target features at `rows` of `source`, projected, written per
        draft layer at (page, offset) (no attention, so never cut)."""
        inputs, m = self.context_inputs, self.model
        dtype = m.fc.weight.dtype
        context = m.project_context(source[inputs["rows"][:size]].to(dtype))
        rope = m.rotary.at(inputs["positions"][:size], dtype)
        self.attn.set_write_slots(inputs["pages"][:size], inputs["offsets"][:size])
        for layer, layer_kv in zip(m.layers, self.kv.layers):
            k, v = layer.self_attn.project_kv(context, rope)
            self.attn.write_kv(layer_kv, k, v)

    def extend(self, requests: list[DraftRequest], features: torch.Tensor, rows: list[int], counts: list[int]) -> None:
        if self.context.features is not None and features.data_ptr() != self.context.features.data_ptr():
            raise ValueError("DFlash reads the verify features from the buffer given at attach")
        for request, row, count in zip(requests, rows, counts):
            self.pending[request.request_id] = (row, count)

    @property
    def context_pool(self) -> PagePool | None:
        return getattr(self, "pool", None)

    def context_table(self, request: DraftRequest) -> PageTable | None:
        return self.tables.get(request.request_id)

    def adopt_context(self, request: DraftRequest, pages: list[int], num_tokens: int) -> None:
        if request.request_id in self.tables:
            raise ValueError(f"request {request.request_id} already has a drafter context")
        table = PageTable(self.pool)
        table.adopt(pages, num_tokens)
        self.tables[request.request_id] = table

    def release(self, request: DraftRequest) -> None:
        table = self.tables.pop(request.request_id, None)
        if table is not None:
            table.free()
            if self.held_tables:  # its held rows are not written (a request coming back gets a new table)
                self.dropped.add(table)
        for state in (self.pending, self.queued, self.unsettled):
            state.pop(request.request_id, None)

    # ---- drafting ----------------------------------------------------------------------------
    def propose(self, requests: list[DraftRequest], length: int | None = None) -> torch.Tensor:
        """One draft step for the batch: draft tokens [B, bs-1] of which the first `length` are scored (valid until
        the next step). Requests drafted ahead (`propose_next`) take those drafts if they are as long; the others
        are drafted now."""
        length = self._length(length)
        queued, self.queued = self.queued, {}
        if self.queued_drafts < length:  # too short for this step: drafted again (their context is written)
            queued = {}
        rows = [queued.get(r.request_id) for r in requests]
        batch = len(requests)
        outputs = [self.drafts_out] + ([self.confidence_out] if self.confidence_out is not None else [])
        if rows == list(range(batch)):  # the batch drafted ahead, in order
            return self._proposed([out[:batch] for out in outputs])
        ahead = [i for i, row in enumerate(rows) if row is not None]
        if not ahead:
            self._step(requests, eager=False, length=length)
            return self._proposed([out[:batch] for out in outputs])
        fresh = [i for i, row in enumerate(rows) if row is None]
        index = upload(np.array(ahead + [rows[i] for i in ahead] + fresh, dtype=np.int64), self.device)
        arranged = [torch.empty(batch, *out.shape[1:], dtype=out.dtype, device=self.device) for out in outputs]
        for into, out in zip(arranged, outputs):  # before a draft rewrites them
            into[index[:len(ahead)]] = out[index[len(ahead):2 * len(ahead)]]
        if fresh:
            self._step([requests[i] for i in fresh], eager=False, length=length)
            for into, out in zip(arranged, outputs):
                into[index[2 * len(ahead):]] = out[:len(fresh)]
        return self._proposed(arranged)

    def _proposed(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """A `propose`'s drafts, its confidences kept beside them (`confidence`)."""
        self.confidence = outputs[1] if len(outputs) > 1 else None
        return outputs[0]

    def propose_candidates(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.candidates_out is None:
            raise ValueError("this drafter was attached without candidates (DraftContext.candidates = 0)")
        queued, self.queued = self.queued, {}
        batch = len(requests)
        if self.queued_candidates and [queued.get(r.request_id) for r in requests] == list(range(batch)):
            return tuple(t[:batch] for t in self.candidates_out)  # the batch drafted ahead, with candidates
        self._step(requests, eager=False, candidates=True)  # drafted again (a queued draft's context is written)
        return tuple(t[:batch] for t in self.candidates_out)

    def draft_logits(self, requests: list[DraftRequest]) -> torch.Tensor:
        """The same step, always eager, returning the block's logits [B, bs-1, vocab] (for checks; with a draft
        vocabulary, [B, bs-1, draft_vocab] over the ids `draft_ids`)."""
        self.queued = {}
        return self._step(requests, eager=True)

    @torch.no_grad()
    def propose_next(self, requests: list[DraftRequest], anchors: torch.Tensor, counts: torch.Tensor,
                     rows: list[int], most: list[int], length: int | None = None, candidates: bool = False) -> bool:
        batch = len(requests)
        if candidates and self.candidates_out is None:
            return False
        length = self._length(None if candidates else length)
        step = CANDIDATES_STEP if candidates else (DRAFT_STEP, length)
        self._write_held()
        if any(r.request_id in self.pending or r.request_id not in self.tables for r in requests):
            return False  # a context not yet written up to the request's position (a step not drafted by `propose`)
        tables = [self.tables[r.request_id] for r in requests]
        starts = table_lengths(tables)  # each request's last written position + 1
        # positions each request commits: planned for the most when the step replays a graph that reads its real
        # lengths on the device; read back when it runs eagerly on the CPU (where reading back costs nothing)
        upper = self.attn.plans_upper_bounds and self.replays(step, batch)
        if not upper and self.device.type == "cuda":
            return False  # reading the counts back would be a second wait for the GPU in the step
        planned = np.asarray(most, dtype=np.int64) if upper else counts[:batch].cpu().numpy().astype(np.int64)
        block = self.block_rows(None if candidates else length)
        kv_lens = starts + planned + block
        if not pool_holds(tables, kv_lens):
            return False
        for table, n in zip(tables, kv_lens.tolist()):
            table.grow(n - table.length)
        layout = BatchLayout.build([block] * batch, kv_lens, planned + block, [t.array for t in tables],
                                   self.page_size, causal=False)
        self.inputs.fill("anchors", [])
        self.inputs.fill("starts", starts)
        self.inputs.fill("counts", [])
        self.inputs.fill("rows", rows)

        def results_into_inputs() -> None:  # the step's results, still on the device
            committed = counts[:batch].long()
            self.inputs["counts"][:batch].copy_(committed)
            self.inputs["starts"][:batch].add_(committed)
            self.inputs["anchors"][:batch].copy_(anchors[:batch])

        self.dispatch(step, batch, layout, self.inputs,
                      lambda size: self._draft_body(size, candidates, None if candidates else length),
                      after_upload=results_into_inputs)
        self.queued = {r.request_id: i for i, r in enumerate(requests)}
        self.queued_drafts, self.queued_candidates = length, candidates
        self.unsettled = dict(zip([r.request_id for r in requests], starts.tolist()))
        return True

    def drafts_ahead(self, requests: list[DraftRequest]) -> torch.Tensor | None:
        batch = len(requests)
        if self.queued_candidates or [self.queued.get(r.request_id) for r in requests] != list(range(batch)):
            return None
        return self.drafts_out[:batch, :self.queued_drafts]

    def settle(self, requests: list[DraftRequest], counts: list[int]) -> None:
        for request, count in zip(requests, counts):
            start = self.unsettled.pop(request.request_id, None)
            if start is not None:  # the context holds the committed positions; the block's slots go back
                self.tables[request.request_id].truncate(start + count)

    @torch.no_grad()
    def _step(self, requests: list[DraftRequest], eager: bool, candidates: bool = False,
              length: int | None = None) -> torch.Tensor | None:
        """One draft step of `requests` scoring `length` drafts each (the whole block with candidates); returns the
        logits when it runs eagerly."""
        batch = len(requests)
        length = self._length(None if candidates else length)
        block = self.block_rows(None if candidates else length)
        self._write_held()
        tables = [self.tables[r.request_id] for r in requests]
        pending = [self.pending.pop(r.request_id, (0, 0)) for r in requests]
        starts = np.array([r.num_cached for r in requests], dtype=np.int64)  # the anchor's position
        counts = np.array([p[1] for p in pending], dtype=np.int64)
        for table, count, start in zip(tables, counts.tolist(), starts.tolist()):
            assert table.length + count == start, "drafter context out of step with the target"
            table.grow(count + block)
        layout = BatchLayout.build([block] * batch, starts + block, counts + block, [t.array for t in tables],
                                   self.page_size, causal=False)
        self.inputs.fill("anchors", [r.pending_token for r in requests])
        self.inputs.fill("starts", starts)
        self.inputs.fill("counts", counts)
        self.inputs.fill("rows", [p[0] for p in pending])
        logits = self.dispatch(CANDIDATES_STEP if candidates else (DRAFT_STEP, length), batch, layout, self.inputs,
                               lambda size: self._draft_body(size, candidates, length), eager=eager)
        for table, start in zip(tables, starts.tolist()):
            table.truncate(start)  # release the block's scratch slots; the context stays
        return logits

    def _draft_body(self, batch: int, candidates: bool = False, length: int | None = None) -> torch.Tensor:
        """The fixed-shape draft step: static inputs and planned page metadata -> the first `length` drafts of each
        request in `drafts_out[:batch]` (None: all bs - 1), from the block `block_rows` gives, and
        with `candidates` (the whole block), each position's top k -> `candidates_out`."""
        bs, inputs, m = self.block_size, self.inputs, self.model
        n = bs - 1 if length is None else length
        b = self.block_rows(None if candidates else n)
        j, jb = self.arange[:bs], self.arange[:b]  # context rows (bs: what a verify may commit), block rows
        self.attn.use_device_lengths(inputs["starts"][:batch] + b)  # planned for upper bounds (`propose_next`)
        starts, counts = inputs["starts"][:batch, None], inputs["counts"][:batch, None]
        ctx_valid = j < counts  # [B, bs]
        # (a padding row's position is kept inside the step's pages: its slot is the scratch page's anyway)
        ctx_pos = torch.minimum(starts - counts + j, starts).clamp(min=0)
        blk_pos = starts + jb
        kv_indices, kv_indptr, ps = self.attn.kv_indices, self.attn.kv_indptr, self.page_size
        requests = self.arange[:batch, None]
        ctx_pages, ctx_offsets = slots_on_device(kv_indices, kv_indptr, requests.expand(batch, bs), ctx_pos, ps)
        ctx_pages = torch.where(ctx_valid, ctx_pages, self.kv.scratch_page)
        blk_pages, blk_offsets = slots_on_device(kv_indices, kv_indptr, requests.expand(batch, b), blk_pos, ps)
        self.attn.set_write_slots(torch.cat([ctx_pages.flatten(), blk_pages.flatten()]),
                                  torch.cat([ctx_offsets.flatten(), blk_offsets.flatten()]))
        if self.context.features is not None:
            # request i's context: bs feature rows from its first one; only its count are real, the rest
            # go to the scratch page
            features = self.context.features
            rows = (inputs["rows"][:batch, None] + j).clamp(max=features.shape[0] - 1)
            context = features[rows.flatten()]
        else:  # no verify features exist yet: every context row is padding
            context = torch.zeros(batch * bs, m.fc.in_features, dtype=m.fc.weight.dtype, device=self.device)
        block_ids = torch.where(jb == 0, inputs["anchors"][:batch, None], self.mask_token_id)
        hidden = self._forward(context, block_ids.flatten(), ctx_pos.flatten(), blk_pos.flatten())
        hidden = hidden.view(batch, b, -1)[:, 1:n + 1].reshape(batch * n, -1)
        logits = m.block_logits(hidden, self.head).view(batch, n, -1)
        index = logits.argmax(dim=-1)
        self.drafts_out[:batch, :n] = self._token_ids(index)
        if self.confidence_out is not None:  # each draft's log-probability beside it (over the tokens the head scores)
            top = logits.gather(-1, index[..., None]).float()
            torch.sub(top, log_normalizer(logits), out=self.confidence_out[:batch, :n, None])
        if candidates:  # the top k of each position, as log-probabilities (over the tokens the head scores)
            logprobs, tokens = self.candidates_out
            top, index = logits.topk(logprobs.shape[-1], dim=-1)
            torch.sub(top.float(), log_normalizer(logits), out=logprobs[:batch])
            tokens[:batch].copy_(self._token_ids(index))
        return logits

    def _block_attention(self, ctx, ctx_rope, blk_rope, layer_kv):
        """Block queries over [context ; block] K/V; the context skips input_layernorm and the MLP."""

        def attend(projections, h):
            q, k_blk, v_blk = projections.project(h, blk_rope)
            k_ctx, v_ctx = projections.project_kv(ctx, ctx_rope)
            self.attn.write_kv(layer_kv, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]))
            return self.attn.attend(q, layer_kv)

        return attend

    def _forward(self, context_features, block_ids, ctx_pos, blk_pos) -> torch.Tensor:
        """Run the draft layers; returns the block's final hidden states [B * block rows, hidden] (pre-norm).
        K/V rows are written in the order [all context rows ; all block rows] (the write slots' order)."""
        m = self.model
        dtype = m.fc.weight.dtype
        ctx = m.project_context(context_features.to(dtype))
        x = self.context.embed_tokens(block_ids).to(dtype) * m.spec.input_embedding_scale
        ctx_rope = m.rotary.at(ctx_pos, dtype)
        blk_rope = m.rotary.at(blk_pos, dtype, fused=m.fused_kernels)
        residual = None
        for layer, layer_kv in zip(m.layers, self.kv.layers):
            x, residual = layer(x, residual, self._block_attention(ctx, ctx_rope, blk_rope, layer_kv))
        return x + residual


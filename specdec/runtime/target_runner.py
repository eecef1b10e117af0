"""Runs the target model: its KV cache, attention backend, static buffers and CUDA graphs.

Three kinds of forward, all appending K/V at each request's end (tables grow here):
- `run_block(tables, first_tokens, rest, q)`: exactly q new tokens per request (q = 1: decode, q =
  block_size: verify). A fixed shape: replayed from the CUDA graph of the next larger batch size when
  graphs are captured, else run eagerly through the same code (`_block_body`).
- the same with `prefill` (`PrefillChunks`), or `run_prefill(prefill)` alone: the step also carries
  prompt chunks, so one forward runs the block rows and the chunks (ragged queries), and an arrival
  never costs a forward of its own. Replayed from piecewise graphs over token counts (everything but
  attention captured; attention planned for the real layout and run between the pieces), else eager
  through the same code (`_mixed_body`).
- `forward(tables, token_ids, q_lens, ...)`: any tokens, always eager (probes).

Block outputs live in static buffers shared by every batch size (logits in the model dtype, their
argmax, and the drafter's features: block rows first, then a step's prompt chunks): they stay valid
until the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from attention.batch_layout import BatchLayout, slots_on_device
from attention.page_pool import PageTable, pool_holds, table_lengths
from attention.transfer import upload
from attention.zero_pages import zeroed
from specdec.models.decoder import Attention, CausalLM, ForwardOutput
from specdec.runtime.cuda_graphs import StaticInputs
from specdec.runtime.model_runner import FixedStep, ModelRunner, TokenStep
from specdec.runtime.piecewise_graphs import Cut
from specdec.runtime.row_budget import budget_lengths, budget_reach, compact_rows


@dataclass
class BlockOutput:
    logits: torch.Tensor  # [B * q, vocab], model dtype
    greedy: torch.Tensor  # [B * q] int64: argmax of the logits
    features: torch.Tensor | None  # [B * q, len(feature_layers) * hidden]


@dataclass
class Carried:
    """First tokens still on the device (overlapped steps): request `rows[i]` of a block starts with
    `values[i]`, a token the previous step sampled and the host has not read back yet."""

    rows: torch.Tensor  # int64, on the device
    values: torch.Tensor  # int64, on the device

    def write(self, block_ids: torch.Tensor) -> None:
        """Into the first column of the block's [B, q] input ids (in place, on the device)."""
        block_ids[:, 0].index_copy_(0, self.rows, self.values)


def write_device_tokens(block_ids: torch.Tensor, rest: torch.Tensor | None, carried: Carried | None) -> None:
    """A block's input ids [B, q] that are already on the device (drafts in columns 1.., tokens carried
    from the previous step in column 0): written there, with no round trip through the host."""
    if rest is not None:
        block_ids[:, 1:].copy_(rest)
    if carried is not None:
        carried.write(block_ids)


@dataclass
class TreeRows:
    """A token tree per request, on the device: the nodes' tokens and depths [B, N] and, with the anchor
    as node 0, which nodes each node sees [B, N + 1, N + 1] (its ancestors and itself); `packed`: those masks
    packed for attention (`attention.batch_layout.pack_tree_masks`), if made with the trees."""

    tokens: torch.Tensor
    depths: torch.Tensor
    masks: torch.Tensor
    packed: torch.Tensor | None = None
    chain: bool = False  # a lone request's nodes form one chain (node i at depth i): the host knows the tree's shape


@dataclass
class PrefillChunks:
    """Prompt chunks that ride along a block step, so that one forward runs both."""

    tables: list[PageTable]
    token_ids: np.ndarray  # every chunk's tokens, flattened (int64)
    lens: list[int]
    logits_rows: np.ndarray  # rows (counted within the chunks) whose logits are wanted
    # logits of logits_rows -> the first tokens of the prompts the chunks complete (on the device), so
    # that they reach the host in the step's one transfer
    sample_first: Callable[[torch.Tensor], torch.Tensor] | None = None
    out: ForwardOutput | None = None  # set by the step: features of every chunk row, logits of logits_rows
    # rows whose logits give prompt logprobs (counted within the chunks), and those logits, set by the step;
    # `echo_plan` is the caller's: which rows are whose
    echo_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    echo_logits: torch.Tensor | None = None
    echo_plan: list = field(default_factory=list)
    first_tokens: list[int] | None = None  # set by the step's transfer
    # the caller's requests: each chunk's, and those whose prompts the chunks complete (the first tokens' order);
    # `context_added`: the step already gave the drafter the chunks' context (drafting ahead needs it first)
    requests: list = field(default_factory=list)
    starting: list = field(default_factory=list)
    context_added: bool = False

    def read_first_tokens(self) -> None:
        """After a forward of the chunks alone: the first tokens of the prompts they complete, to the host."""
        if self.sample_first is not None:
            self.first_tokens = self.sample_first(self.out.logits).tolist()


class TargetRunner(ModelRunner):
    def __init__(self, model: CausalLM, *, backend_name: str, kv_dtype: torch.dtype | tuple[torch.dtype, ...],
                 page_size: int, max_batch: int, block_lens: tuple[int, ...], max_prefill_tokens: int,
                 max_context: int | None = None, feature_layers: tuple[int, ...] = (), tree_nodes: int = 0,
                 budgets: tuple[tuple[int, int], ...] = (), verify_ahead: bool = False,
                 verify_ahead_batches: bool = False):
        """max_context: the longest prompt + output served (None: the model's context). tree_nodes: a token tree's
        draft nodes per request at small batches (0: no trees). budgets: the budget steps, as (q, per): blocks of q
        (one of `block_lens`) verifying on average per tokens a request (`run_budget`). verify_ahead: a lone request's verifies may be queued before their start is known
        (`run_block_ahead`); verify_ahead_batches: those of batches too, where their rung keeps each request's KV in
        one piece."""
        dtype = model.model.embed_tokens.weight.dtype
        super().__init__(model, backend_name=backend_name, kv_dtype=kv_dtype, q_dtype=dtype, page_size=page_size,
                         max_batch=max_batch, device=next(model.parameters()).device)
        self.dtype = dtype
        self.feature_layers = feature_layers
        self.verify_ahead = verify_ahead
        self.verify_ahead_batches = verify_ahead_batches
        c, q_max = model.config, max(block_lens)
        max_context = c.max_position_embeddings if max_context is None else max_context
        # a request's KV: its context and the slots a step writes past it
        self.attn.bound_sequence_pages(-(-(max_context + max(q_max, tree_nodes + 1)) // page_size))
        # pages outside the pool where a lone request's small trees attend as a decode does (the node rows of
        # attention/node_rows.py, where the backend has them)
        self.spare_pages = self.attn.spare_pages_wanted(page_size) if tree_nodes else 0
        # static buffers of the fixed-shape steps, allocated before the KV pool is sized
        rows = max(max_batch * q_max, tree_nodes + 1 if tree_nodes else 0)  # a tree at batch 1 always fits
        self.tree_nodes = tree_nodes
        self.inputs = {q: StaticInputs({"ids": max_batch * q, "starts": max_batch}, self.device) for q in block_lens}
        self.logits_out = zeroed((rows, c.vocab_size), dtype, self.device)
        self.greedy_out = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.arange = torch.arange(rows, device=self.device)
        # a mixed step's tokens: every request's block and the prefill budget (a multiple of the block, so
        # the drafter can view the features block by block)
        self.max_step_tokens = -(-(rows + max_prefill_tokens) // q_max) * q_max
        self.attn.reserve_write_rows(self.max_step_tokens)
        feature_dim = len(feature_layers) * c.hidden_size
        self.features_out = zeroed((self.max_step_tokens, feature_dim), dtype, self.device) if feature_layers else None
        self.mixed = MixedStepBuffers(self.max_step_tokens, model, self.device)
        self.mixed_step = TokenStep("mixed", "target mixed", self.max_step_tokens, self.mixed.inputs, self._mixed_body)
        if tree_nodes:  # token-tree verify steps, captured up to TREE_GRAPH_MAX_BATCH requests
            tree_rows = max(size * self.tree_q(size) for size in range(1, min(max_batch, TREE_GRAPH_MAX_BATCH) + 1))
            self.tree_inputs = StaticInputs({"ids": tree_rows, "starts": max_batch, "depths": tree_rows}, self.device)
        self.budgets = budgets
        if any(q not in block_lens or not 1 <= per <= q for q, per in budgets):
            raise ValueError(f"budget steps {budgets} need blocks among {block_lens} and 1 <= per <= q")
        if budgets:  # a budget step's reach (input), lengths (output) and its verified rows' features; their logits
            # stay in the first rows of `logits_out` (a chain's layout is asked for by sampling only, `run_budget`)
            budget_rows = max_batch * max(per for _, per in budgets)
            self.budget_reach = torch.zeros(max_batch, q_max - 1, dtype=torch.float32, device=self.device)
            self.budget_lengths = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            # each verified row's place in the chain's layout (output): where sampling's logits go
            self.budget_places = torch.zeros(budget_rows, dtype=torch.long, device=self.device)
            self.budget_features = (torch.zeros(budget_rows, feature_dim, dtype=dtype, device=self.device)
                                    if feature_layers else None)
        # the K/V slot (page, offset) of every row of the last token-tree step (request by request; rows past the
        # step's on the scratch page), written on the device by the step: the accepted path's K/V moves read it
        self.tree_slots = torch.zeros(2, rows if tree_nodes else 0, dtype=torch.long, device=self.device)

    def tree_q(self, size: int) -> int:
        """Tokens per request (the anchor and the nodes) of a token-tree step of `size` requests: a tree of
        up to tree_nodes nodes, fewer as the batch grows so that the step fits the block rows. A lone request's tree
        has at most the rows the backend attends with a decode's bits (`AttentionBackend.exact_tree_rows`), so that
        greedy trees reproduce plain decoding at batch 1."""
        nodes = min(self.tree_nodes, self.logits_out.shape[0] // size - 1)
        exact_rows = self.attn.exact_tree_rows()
        return (min(nodes, exact_rows - 1) if size == 1 and exact_rows else nodes) + 1

    def fixed_steps(self) -> list[FixedStep]:
        """One step per block length q: q new tokens per request (q = 1 decode, q = block size verify), and
        the token-tree verify of small batches (q by batch, see `tree_q`)."""
        steps = [FixedStep(q, f"target q={q}",
                           lambda batch, scratch, q=q: BatchLayout.dummy(batch, q, q, self.page_size, scratch, True),
                           q, lambda batch, q=q: self._block_body(q, batch)) for q in self.inputs]
        steps += [FixedStep((BUDGET_STEP, q, per), f"target budget q={q} per={per}",
                            lambda batch, scratch, q=q: BatchLayout.dummy(batch, q, q, self.page_size, scratch, True),
                            q, lambda batch, q=q, per=per: self._budget_body(q, per, batch)) for q, per in self.budgets]
        if self.tree_nodes and self.attn.supports_graphs:
            # a request's rows at most: a lone request's tree may be the smaller one (`tree_q`)
            steps.append(FixedStep(TREE_STEP, "target tree", self._tree_dummy, self.tree_nodes + 1, self._tree_body,
                                   max_rung=TREE_GRAPH_MAX_BATCH))
        return steps

    def _tree_dummy(self, batch: int, scratch: int) -> BatchLayout:
        q = self.tree_q(batch)
        masks = torch.ones(q, q, dtype=torch.bool, device=self.device).tril().expand(batch, q, q)
        return BatchLayout.dummy(batch, q, q, self.page_size, scratch, True).with_query_masks(masks)

    def token_steps(self) -> list[TokenStep]:
        """Steps that mix prompt chunks with decode / verify tokens (or prompt chunks alone)."""
        return [self.mixed_step] if self.attn.supports_graphs else []

    # ---- forwards ----------------------------------------------------------------------------
    def forward(self, tables: list[PageTable], token_ids: torch.Tensor, q_lens: list[int], *,
                logits_rows: torch.Tensor | None, feature_layers: tuple[int, ...] = (),
                positions: np.ndarray | None = None, query_masks: torch.Tensor | None = None) -> ForwardOutput:
        """q_lens[i] new tokens of request i (flattened in `token_ids`) written at slots length.., causal;
        always eager (probes). A token tree gives its nodes' `positions` (the anchor's plus their depth)
        and `query_masks` ([B, max_q, max_q]: each node sees its ancestors and itself, see BatchLayout)."""
        layout = self._grow(tables, q_lens)
        if query_masks is not None:
            layout = layout.with_query_masks(query_masks)
        self.attn.plan(layout)
        positions = upload((layout.new_kv_positions() if positions is None else positions).astype(np.int64),
                           self.device)
        return self.model(token_ids, positions, self.kv, self.attn, logits_rows=logits_rows,
                          feature_layers=feature_layers)

    def _grow(self, tables: list[PageTable], q_lens: list[int], lengths: np.ndarray | None = None) -> BatchLayout:
        """Append q_lens[i] tokens to request i's table; the causal layout of those new tokens. `lengths`: the tables'
        lengths before (`table_lengths`), where the caller has read them already."""
        if lengths is None:
            lengths = table_lengths(tables)
        ends = (lengths + np.asarray(q_lens)).astype(np.int32)
        for table, n in zip(tables, q_lens):
            table.grow(n)
        return BatchLayout.for_tokens(q_lens, ends, [t.array for t in tables], self.page_size, causal=True,
                                      expected_kv_len=tables[0].expected_length if len(tables) == 1 else 0)

    def run_block(self, tables: list[PageTable], first_tokens: list[int], rest: torch.Tensor | None,
                  q: int, prefill: PrefillChunks | None = None, carried: Carried | None = None) -> BlockOutput:
        """Each request gets [first_tokens[i], *rest[i]] (rest: [B, q - 1] on the device, or None for q = 1);
        `carried` replaces some first tokens with ones still on the device (overlapped steps).
        With `prefill`, its chunks run in the same forward and `prefill.out` is set; a step whose graph rung declines
        its KV lengths (`AttentionBackend.graph_fits`) runs the same way, without chunks."""
        if prefill is not None:
            return self._run_mixed(tables, first_tokens, rest, q, prefill, carried)
        batch = len(tables)
        starts = table_lengths(tables)  # read once (a pass over the batch): the rung's check, the layout, the inputs
        if self._rung_declines(q, starts):
            return self._run_mixed(tables, first_tokens, rest, q, prefill, carried)
        layout, inputs = self._stage_block(tables, first_tokens, q, starts)

        def device_tokens_into_ids() -> None:
            write_device_tokens(inputs["ids"].view(-1, q)[:batch], rest, carried)

        self.dispatch(q, batch, layout, inputs, lambda b: self._block_body(q, b),
                      after_upload=device_tokens_into_ids if rest is not None or carried is not None else None)
        return self._block_output(batch * q)

    def queues_verify_ahead(self, batch: int) -> bool:
        """Whether a verify of `batch` requests may be queued before their starts are known (`run_block_ahead`): a
        lone request's with `verify_ahead`, a batch's with `verify_ahead_batches`."""
        return self.verify_ahead if batch == 1 else self.verify_ahead_batches

    def run_block_ahead(self, tables: list[PageTable], q: int, anchors: torch.Tensor, rest: torch.Tensor,
                        accepted: torch.Tensor, most: int) -> BlockOutput | None:
        """The next verify of q rows per request, queued before this step's acceptance reaches the host: the first
        tokens `anchors` [B] and drafts `rest` [B, q - 1] are on the device, and so is `accepted` [B], the drafts this
        step accepts (fewer than `most`, the rows it verified, the last of each table's length). Each verify starts
        after them and the bonus; the host knows only that start's range. The step is planned at the latest start of
        every request, its starts are written on the device, and its graph writes the real page metadata from them,
        where a plan there serves every start of the range: a lone request's query-rows rung whose rows keep their KV
        chunks over it (`AttentionBackend.rows_plan_serves`), a batch's rung that keeps each request's KV in one
        piece (its plan depends on the query counts alone: `use_device_lengths`). The tables then hold the pages of
        the latest starts' verify (the caller rolls them back to the real lengths as after any verify; the next step
        grows them by q again). None where that is not so: not queued. On the CPU the acceptance is read back (at no
        cost there) and the verify runs at its real starts."""
        batch = len(tables)
        if self.device.type != "cuda":
            for table, count in zip(tables, accepted.tolist()):
                table.truncate(table.length - most + count + 1)
            if not pool_holds(tables, table_lengths(tables) + q):
                return None
            return self.run_block(tables, anchors.tolist(), rest, q)
        latest = table_lengths(tables)  # every draft of this step accepted
        if not self.queues_verify_ahead(batch) or not self._plan_serves_ahead(tables, q, latest, most):
            return None
        layout, inputs = self._stage_block(tables, [0] * batch, q, latest)

        def device_inputs() -> None:
            write_device_tokens(inputs["ids"][:batch * q].view(batch, q), rest,
                                Carried(self.arange[:batch], anchors.long()))
            inputs["starts"][:batch].add_(accepted.long() + 1 - most)  # the graph makes the page metadata from them

        self.dispatch(q, batch, layout, inputs, lambda b: self._block_body(q, b), after_upload=device_inputs)
        return self._block_output(batch * q)

    def _plan_serves_ahead(self, tables: list[PageTable], q: int, latest: np.ndarray, most: int) -> bool:
        """Whether a verify of q rows planned at the latest starts `latest` serves every start down to `most` - 1
        before them (see `run_block_ahead`), with room in the pool for the latest."""
        rung = self.rung_for(q, len(tables))
        if rung is None or not pool_holds(tables, latest + q):  # only a rung's graph makes the page metadata
            return False
        slot = self.ladders[q].slot(rung)
        if len(tables) == 1:
            return self.attn.rows_plan_serves(slot, q, (int(latest[0]) - most + 1 + q, int(latest[0]) + q),
                                              tables[0].expected_length, self.page_size)
        return self.attn.lengths_plan_serves(slot) and self.attn.graph_fits(slot, lambda: latest + q)

    def _stage_block(self, tables: list[PageTable], first_tokens: list[int], q: int,
                     starts: np.ndarray) -> tuple[BatchLayout, StaticInputs]:
        """A block step's host side: each table grown by q (their lengths before: `starts`), and the step's inputs
        filled with the first tokens and the starts (the rest of each block comes on the device). Returns the block's
        layout and its inputs."""
        layout = self._grow(tables, [q] * len(tables), starts)
        inputs = self.inputs[q]
        ids = np.zeros((len(tables), q), dtype=np.int64)
        ids[:, 0] = first_tokens
        inputs.fill("ids", ids)
        inputs.fill("starts", starts)
        return layout, inputs

    def _rung_declines(self, q: int, starts: np.ndarray, key=None, expected_kv_len: int = 0) -> bool:
        """Whether the graph rung that would replay a block step (of `key`, default q) of requests at lengths `starts`
        declines their KV lengths after it (one request's KV far longer than the others' where the rung keeps each in
        one piece; a lone tree across a KV chunk boundary where its rung plans node rows). `expected_kv_len`: a lone
        request's length at most."""
        key = q if key is None else key
        rung = self.rung_for(key, len(starts))
        return rung is not None and not self.attn.graph_fits(self.ladders[key].slot(rung), lambda: starts + q,
                                                             expected_kv_len)

    def run_budget(self, tables: list[PageTable], first_tokens: list[int], rest: torch.Tensor,
                   confidence: torch.Tensor, q: int, per: int,
                   logits: bool = False) -> tuple[BlockOutput, torch.Tensor]:
        """A block step of q tokens per request ([first_tokens[i], *rest[i]], rest [B, q - 1] on the device) that
        runs the target over only B * per of them: each request's anchor and the drafts most likely to be kept by
        their drafted log-probabilities `confidence` [B, >= q - 1] (specdec/runtime/row_budget.py). Returns the
        block's outputs laid out as a chain of q's (row i * q + j: request i's token j; `greedy` -1 at the rows not
        run; `logits` so laid out only when asked, stale at the rows not run, else the verified rows' in their order
        first) and each request's verified tokens [B] (on the device). Its K/V slots are those of a chain of q; the
        rows not run are never written. A rung that declines the batch's KV lengths runs the whole chain (every
        length q)."""
        batch = len(tables)
        key = (BUDGET_STEP, q, per)
        starts = table_lengths(tables)
        if self._rung_declines(q, starts, key):
            out = self._run_mixed(tables, first_tokens, rest, q, None)
            return out, self.budget_lengths[:batch].fill_(q)
        layout, inputs = self._stage_block(tables, first_tokens, q, starts)
        rung = self.rung_for(key, batch) or batch

        def device_inputs() -> None:
            write_device_tokens(inputs["ids"].view(-1, q)[:batch], rest, None)
            budget_reach(confidence[:, :q - 1], rung, per, out=self.budget_reach[:rung, :q - 1])

        self.dispatch(key, batch, layout, inputs, lambda b: self._budget_body(q, per, b), after_upload=device_inputs)
        if logits:  # the verified rows' logits into the chain's layout (sampling reads them there): a copy of them
            # first, since their places overlap their rows (the copy lasts the step; a static one would hold
            # max_batch * per * vocab for steps that seldom sample)
            rows = rung * per
            self.logits_out[:rung * q].index_copy_(0, self.budget_places[:rows], self.logits_out[:rows].clone())
        return self._block_output(batch * q), self.budget_lengths[:batch]

    def _budget_body(self, q: int, per: int, batch: int) -> None:
        """The budget step of `batch` requests (a graph rung): the rows' shares from `budget_reach`, the forward over
        them alone (attention scattering their queries into the chain's layout it was planned for and gathering its
        output back), their argmax and features scattered into the chain's layout."""
        inputs, rows, chain_rows = self.inputs[q], batch * per, batch * q
        lengths = budget_lengths(self.budget_reach[:batch, :q - 1], rows)
        self.budget_lengths[:batch].copy_(lengths)
        request, column = compact_rows(lengths, rows)
        run = request * q + column  # each verified row's place in the chain's layout
        self.budget_places[:rows].copy_(run)
        positions = inputs["starts"][:batch][request] + column
        self.attn.set_write_slots(*slots_on_device(self.attn.kv_indices, self.attn.kv_indptr, request, positions,
                                                   self.page_size))
        query, attention = self.mixed.query[:chain_rows], self.mixed.attention[:chain_rows]

        def layer_attention(i: int, rope) -> Attention:
            layer_kv = self.kv.layers[i]

            def attend(projections, h: torch.Tensor) -> torch.Tensor:
                q_rows, k, v = projections.project(h, rope)
                self.attn.write_kv(layer_kv, k, v)
                query.index_copy_(0, run, q_rows)
                self.attn.attend(query, layer_kv, out=attention)
                return attention.index_select(0, run)

            return attend

        features = self.budget_features[:rows] if self.budget_features is not None else None
        hidden, _ = self.model.hidden_states(inputs["ids"][:chain_rows][run], positions, layer_attention,
                                             feature_layers=self.feature_layers, features_out=features)
        self.model.logits(hidden, self.logits_out[:rows])
        self.greedy_out[:chain_rows].fill_(-1)
        self.greedy_out[:chain_rows].index_copy_(0, run, self.logits_out[:rows].argmax(dim=-1))
        if features is not None:
            self.features_out[:chain_rows].index_copy_(0, run, features)

    def run_prefill(self, prefill: PrefillChunks) -> None:
        """Prompt chunks alone (a step with nothing to decode); sets `prefill.out`."""
        self._run_mixed([], [], None, 1, prefill)

    def run_prefill_after(self, prefill: PrefillChunks | None, features: torch.Tensor) -> int:
        """Prompt chunks (if any) in a forward of their own after a step's verify, whose feature rows `features` were
        taken out of the features buffer first (that forward fills it from its first row): they then go right after
        the chunks' rows, where the drafter reads them. Returns the row they start at."""
        first_row = 0
        if prefill is not None:
            self.run_prefill(prefill)
            first_row = sum(prefill.lens)
        self.features_out[first_row:first_row + features.shape[0]].copy_(features)
        return first_row

    def run_tree(self, tables: list[PageTable], anchors: list[int], tree: TreeRows) -> BlockOutput:
        """A token tree per request in one forward: [anchor, nodes...] at the anchor's position plus each
        node's depth, each node seeing the context, its ancestors and itself (`tree.masks`). Replayed from
        the tree step's graph of the next larger rung when one holds the batch and its tree size, else the
        mixed token step (piecewise graphs; attention planned with the masks, eager between the pieces)."""
        batch, q = len(tables), tree.tokens.shape[1] + 1
        rung = self.rung_for(TREE_STEP, batch)
        starts = table_lengths(tables)
        if rung is None or self.tree_q(rung) != q or (not tree.chain and self.lone_tree_declined(tables, q, starts)):
            return self._run_mixed(tables, anchors, tree.tokens, q, None, tree=tree)
        layout = self._grow(tables, [q] * batch, starts).with_query_masks(tree.masks, tree.packed, tree.chain)
        inputs = self.tree_inputs
        ids = np.zeros((batch, q), dtype=np.int64)
        ids[:, 0] = anchors
        inputs.fill("ids", ids)
        inputs.fill("starts", starts)
        inputs.fill("depths", [])

        def tree_into_inputs() -> None:  # the nodes' tokens and depths are on the device already
            write_device_tokens(inputs["ids"][:batch * q].view(batch, q), tree.tokens, None)
            inputs["depths"][:batch * q].view(batch, q)[:, 1:].copy_(tree.depths)

        self.dispatch(TREE_STEP, batch, layout, inputs, self._tree_body, after_upload=tree_into_inputs)
        return self._block_output(batch * q)

    def lone_tree_declined(self, tables: list[PageTable], q: int, starts: np.ndarray | None = None) -> bool:
        """Whether the tree step's graph rung declines a lone request's tree of q rows after these tables (lengths
        `starts`, if read already) whatever its shape: its nodes attend as node rows, and a KV chunk boundary falls
        between the shallowest and the deepest one (`AttentionBackend.graph_fits`). A tree whose nodes form one chain
        (`TreeRows.chain`) it replays."""
        starts = table_lengths(tables) if starts is None else starts
        return len(tables) == 1 and self._rung_declines(q, starts, TREE_STEP, tables[0].expected_length)

    def _tree_body(self, batch: int) -> None:
        """The token-tree verify of `batch` requests (a graph rung): RoPE at each node's depth past the anchor."""
        q = self.tree_q(batch)
        self.attn.use_device_tree()
        self._fixed_forward(self.tree_inputs, batch, q, self.tree_inputs["depths"][:batch * q].view(batch, q))
        self._keep_tree_slots(self.attn.write_pages, self.attn.write_offsets)

    def _keep_tree_slots(self, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        """The tree step's write slots, row by row from its first (`tree_slots`), for its K/V moves."""
        for row, slots in zip(self.tree_slots, (pages, offsets)):
            row[:len(slots)].copy_(slots)

    def _block_output(self, n: int) -> BlockOutput:
        features = self.features_out[:n] if self.features_out is not None else None
        return BlockOutput(self.logits_out[:n], self.greedy_out[:n], features)

    def _run_mixed(self, tables: list[PageTable], first_tokens: list[int], rest: torch.Tensor | None, q: int,
                   prefill: PrefillChunks | None, carried: Carried | None = None,
                   tree: TreeRows | None = None) -> BlockOutput:
        """The block step and the prompt chunks in one forward (ragged queries, causal): block rows first,
        then the chunks. Replayed from the piecewise graphs of the next larger token count when they are
        captured, else eager. Block outputs land in the static buffers, as a block step's do. With `tree`,
        the block rows are token trees (no chunks)."""
        n = len(tables) * q
        if n > self.logits_out.shape[0]:
            raise ValueError(f"a step of {n} verify rows exceeds the {self.logits_out.shape[0]} the runner was "
                             "sized for")
        chunk_tables, chunk_lens = (prefill.tables, prefill.lens) if prefill is not None else ([], [])
        block_ids = np.zeros((len(tables), q), dtype=np.int64)
        block_ids[:, 0] = first_tokens
        ids = block_ids.reshape(-1)
        if prefill is not None:
            ids = np.concatenate([ids, prefill.token_ids])
        total = len(ids)
        if total > self.max_step_tokens:
            raise ValueError(f"a step of {total} tokens exceeds the {self.max_step_tokens} the runner was sized for")
        layout = replace(self._grow([*tables, *chunk_tables], [q] * len(tables) + chunk_lens), prompts=len(chunk_lens))
        if tree is not None:
            layout = layout.with_query_masks(tree.masks, tree.packed, tree.chain)
        self.attn.plan(layout, write_slots=False)  # the step writes K/V to the slots staged here
        # what attention reads as this step's slots between the pieces (a token tree's rows, read back)
        self.attn.set_write_slots(self.mixed.inputs["pages"], self.mixed.inputs["offsets"])
        self.stage_token_rows(self.mixed_step, layout)
        self.mixed.inputs.fill("ids", ids)
        self.mixed.inputs.upload()
        write_device_tokens(self.mixed.inputs["ids"][:n].view(-1, q), rest, carried)
        if tree is not None:  # a node sits at the anchor's position plus its depth
            positions = self.mixed.inputs["positions"][:n].view(-1, q)
            positions[:, 1:] = positions[:, :1] + tree.depths
            rows = self.tree_slots.shape[1]  # all of them: rows past the step's are staged on the scratch page
            self._keep_tree_slots(self.mixed.inputs["pages"][:rows], self.mixed.inputs["offsets"][:rows])
        self.run_tokens(self.mixed_step, total, eager=not self._graphs_usable())
        hidden = self.mixed.hidden[:total]
        if n:
            block_rows = self._lm_head_rows(len(tables), q)
            self.model.logits(self.mixed.hidden[:block_rows], self.logits_out[:block_rows])
            torch.argmax(self.logits_out[:n], dim=-1, out=self.greedy_out[:n])
        if prefill is None:
            return self._block_output(n)
        rows = np.concatenate([prefill.logits_rows, prefill.echo_rows]).astype(np.int64)
        # a few first tokens: their count padded to a power of two by repeating the last row, a handful of GEMM shapes
        # (see `_lm_head_rows`); a prompt's echoed rows (prompt logprobs) as they are, their logits already large
        padded = (np.pad(rows, (0, (1 << (len(rows) - 1).bit_length()) - len(rows)), mode="edge")
                  if 0 < len(rows) <= PADDED_FIRST_ROWS else rows)
        logits = self.model.logits(hidden[n + upload(padded, self.device)])[:len(rows)] if len(rows) else None
        if len(prefill.echo_rows):
            first = len(prefill.logits_rows)
            logits, prefill.echo_logits = (logits[:first] if first else None), logits[first:]
        features = self.features_out[n:total] if self.features_out is not None else None
        prefill.out = ForwardOutput(logits, features)
        return self._block_output(n)

    def _lm_head_rows(self, batch: int, q: int) -> int:
        """The rows a mixed step's output layer runs over for its `batch` requests' blocks of q: those of the block
        step's graph rung for the batch (rung times q), past the block rows the step's other rows or stale ones, whose
        logits are never read. A GEMM's first call at a row count cuBLAS has not met costs the host 0.1-4 ms choosing
        its kernel (an H200, 2026-11-27); a rung's count was met in its capture's warm-up. The rung's count also gives
        each row the bits the graph step gives it."""
        rung = self.rung_for(q, batch)
        return min(rung * q, self.logits_out.shape[0]) if rung is not None else batch * q

    def _graphs_usable(self) -> bool:
        """An FP8 cache still calibrating its scales reads them back on the host: not capturable."""
        return not any(layer.calibrate_next_write for layer in self.kv.layers)

    def _mixed_body(self, size: int, cut: Cut) -> None:
        """The mixed step over `size` token rows, cut at each layer's attention: reads the staged inputs,
        writes the final hidden states and the features into static buffers."""
        inputs, mixed = self.mixed.inputs, self.mixed
        self.attn.set_write_slots(inputs["pages"][:size], inputs["offsets"][:size])

        def layer_attention(i: int, rope) -> Attention:
            layer_kv = self.kv.layers[i]

            def attend(projections, h: torch.Tensor) -> torch.Tensor:
                q, k, v = projections.project(h, rope)
                self.attn.write_kv(layer_kv, k, v)
                mixed.query[:size].copy_(q)
                cut(lambda tokens: self.attn.attend(mixed.query[:tokens], layer_kv, out=mixed.attention[:tokens]))
                return mixed.attention[:size]

            return attend

        hidden, _ = self.model.hidden_states(
            inputs["ids"][:size], inputs["positions"][:size], layer_attention, feature_layers=self.feature_layers,
            features_out=self.features_out[:size] if self.features_out is not None else None)
        mixed.hidden[:size].copy_(hidden)

    def _block_body(self, q: int, batch: int) -> None:
        """The fixed-shape step: reads static inputs and the planned page metadata, writes static outputs.
        With verifies queued ahead, a lone request's query-rows rung (batch 1) first writes its rows' page metadata
        for the start in its inputs (`use_device_rows`): a verify queued ahead was planned for a later start than its
        real one, and this, captured in the graph, costs the host nothing (done eagerly, its ~20 small operations were
        about a third of the host time of queuing a verify ahead: BENCHMARKS.md); a step planned at its real start
        gets the same metadata back; an eager step (no rung) is planned at its real start and leaves it alone. With
        batches' verifies queued ahead, a batch's rung that keeps each request's KV in one piece does the same with
        every request's length (`use_device_lengths`; a no-op on other rungs)."""
        if self.verify_ahead and batch == 1:
            self.attn.use_device_rows(self.inputs[q]["starts"][:1] + q)
        elif self.verify_ahead_batches and batch > 1:  # padding requests: start 0, their planned length q
            self.attn.use_device_lengths(self.inputs[q]["starts"][:batch] + q)
        self._fixed_forward(self.inputs[q], batch, q)

    def _fixed_forward(self, inputs: StaticInputs, batch: int, q: int, offsets: torch.Tensor | None = None) -> None:
        """q new tokens per request written at consecutive slots from its start, RoPE at start + `offsets`
        ([batch, q]; None: the slots' own positions), all rows' logits and their argmax, the features."""
        n = batch * q
        starts = inputs["starts"][:batch, None]
        slots = (starts + self.arange[:q]).reshape(-1)
        positions = slots if offsets is None else (starts + offsets).reshape(-1)
        requests = self.arange[:batch].repeat_interleave(q)
        self.attn.set_write_slots(*slots_on_device(self.attn.kv_indices, self.attn.kv_indptr, requests, slots,
                                                   self.page_size))
        out = self.model(inputs["ids"][:n], positions, self.kv, self.attn, logits_rows=slice(None),
                         feature_layers=self.feature_layers, logits_out=self.logits_out[:n])
        torch.argmax(out.logits, dim=-1, out=self.greedy_out[:n])
        if self.features_out is not None:
            self.features_out[:n].copy_(out.features)


TREE_STEP = "tree"  # the token-tree verify step's graph ladder
BUDGET_STEP = "budget"  # the budget steps' graph ladders, keyed (BUDGET_STEP, q, per)
PADDED_FIRST_ROWS = 64  # the most first-token rows of a mixed step padded to a power of two
TREE_GRAPH_MAX_BATCH = 16  # trees pay at small batches; larger tree steps run the mixed step's graphs


class MixedStepBuffers:
    """Static buffers of the mixed steps' piecewise graphs: the staged inputs (token ids, positions and
    K/V write slots of every row; padding rows write to the scratch page), the attention's query and
    output between the pieces, and the final hidden states."""

    def __init__(self, max_tokens: int, model: CausalLM, device: torch.device):
        c, dtype = model.config, model.model.embed_tokens.weight.dtype
        self.inputs = StaticInputs({name: max_tokens for name in ("ids", "positions", "pages", "offsets")}, device)
        self.query, self.attention = (zeroed((max_tokens, c.num_attention_heads, model.head_dim), dtype, device)
                                      for _ in range(2))
        self.hidden = zeroed((max_tokens, c.hidden_size), dtype, device)

"""The speculative step over a token tree per request (verify="tree", and the tree option of "auto").

    candidates = drafter.propose_candidates(batch)      # each block position's top-k drafts, log-probabilities
    tree       = TokenTree.build(candidates, budget)    # the best `budget` nodes per request (one graph)
    verify     = target([anchor, nodes...])             # one forward: each node sees the context, its ancestors
                                                        # and itself, at the anchor's position plus its depth
    path, a, bonus = tree.accept(target tokens)         # greedy argmax or the target's sample at every node (one graph)
    K/V of the accepted path move into place (start + 1 .. start + a) on the device; the rest of the tree
    goes back; the drafter's context grows by the features of the anchor and the accepted path.
    With `draft_ahead` (and no prompt chunk in the step) the next step's draft with candidates is queued
    after the step's tokens start on their way to the host and before the host reads them, from the acceptance
    on the device (`Drafter.propose_next`): the GPU drafts while the host commits, and that context growth
    happens in the queued draft.

Everything between the draft and the step's one device-to-host transfer stays on the device: the tree's
building and its acceptance are replayed from CUDA graphs per batch rung (`BatchGraphs`), the verify is
the target's tree step (one graph per rung up to 16 requests, the mixed step's piecewise graphs above;
attention planned with the tree's masks), and the K/V moves, part of the acceptance's graph, read the
verify's own write slots (`TargetRunner.tree_slots`). No host work grows with the tree.

The node budget shrinks as the batch grows: a step verifies at most as many rows as the runner holds
(`max_num_seqs` x block_size, or one tree of the largest budget; `TargetRunner.tree_q`), so the largest
trees run at small batches, where a verify of 64 tokens per request costs about what one of 16 does.

Sampling stays lossless as on the chain: a node is kept only when its token equals the target's own
draw at its parent, and each node's draw is the target's at a prefix that is exactly the committed text
(the draft candidates are one-hot choices, as the chain's drafts are). Prompt chunks of the step run in
a forward of their own after the verify (a tree's mask is not a prompt chunk's).
"""

from __future__ import annotations

import torch

from attention.batch_layout import pack_tree_masks
from attention.fused import fused_if, fusing
from specdec.engine.decoding import StepTransfer
from specdec.engine.drafter import Drafter
from specdec.engine.request import Request
from specdec.engine.sampler import sample_block
from specdec.engine.token_tree import PossibleNodes, TokenTree, possible_nodes
from specdec.runtime.cuda_graphs import BatchGraphs, ladder_sizes
from specdec.runtime.target_runner import PrefillChunks, TargetRunner, TreeRows

CANDIDATES_PER_POSITION = 4
# the log-probability that keeps a candidate out of every tree of at most the block's positions in nodes: the first
# candidates' paths score above it
NOT_A_CANDIDATE = -1e9


def build_trees(logprobs: torch.Tensor, tokens: torch.Tensor, nodes: int, at_once: bool = True,
                possible: PossibleNodes | None = None) -> tuple[torch.Tensor, ...]:
    """What a tree step's building graph makes from each request's candidates [B, n, k]: the trees' tokens, parents,
    depths, scores and ranks (`TokenTree.build`), their ancestor masks, and the masks packed for the verify's
    attention, here in the graph, where packing them per step took ~0.2 ms of host time (its launches) on the step's
    path."""
    tree = TokenTree.build(logprobs, tokens, nodes, at_once=at_once, possible=possible)
    mask = tree.attention_mask()
    return (tree.tokens, tree.parents, tree.depths, tree.scores, tree.ranks, mask,
            pack_tree_masks(mask).view(logprobs.shape[0], -1))


def accept_trees(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                 ranks: torch.Tensor, mask: torch.Tensor, chosen: torch.Tensor, depth: int) -> tuple[torch.Tensor, ...]:
    """What a tree step's acceptance graph makes from its trees (`TokenTree` fields and masks) and the target's token
    after each node `chosen` [B, N+1]: the accepted path (`TokenTree.accept`), its length and the bonus, the path's
    tokens, how many drafts the chain (each position's first candidate) would have had accepted (the leading path
    nodes of rank 0), and which of the block's `depth` positions the path holds."""
    tree = TokenTree(tokens, parents, depths, scores, ranks, depth)
    path, accepted, bonus = tree.accept(chosen, mask)
    accepted_steps = torch.arange(depth, device=path.device) < accepted[:, None]
    on_path = (path - 1).clamp(min=0)
    first_choice = (ranks.gather(1, on_path) == 0) & accepted_steps
    chain = first_choice.long().cumprod(dim=1).sum(dim=1)
    return path, accepted, bonus, tokens.gather(1, on_path), chain, accepted_steps


class TreeDecoding:
    def __init__(self, runner: TargetRunner, drafter: Drafter, draft_ahead: bool = False):
        self.runner = runner
        self.drafter = drafter
        # queue the next step's draft with candidates before reading this step's tokens (`Drafter.propose_next`)
        self.draft_ahead = draft_ahead
        self.depth = drafter.block_size - 1
        self.tokens_per_step = drafter.block_size  # the most a step commits per request (a path of bs - 1 + bonus)
        self.verify_length = 0  # tokens per request the last step verified: the anchor and the nodes
        self.chain_accepted: list[int] = []  # per request of the last step: drafts the chain would have had accepted
        batch, device, k = runner.max_batch, runner.device, CANDIDATES_PER_POSITION
        self.candidates = (torch.zeros(batch, self.depth, k, dtype=torch.float32, device=device),
                           torch.zeros(batch, self.depth, k, dtype=torch.long, device=device))
        # the target's token after each node
        self.chosen = torch.zeros(runner.logits_out.shape[0], dtype=torch.long, device=device)
        sizes = ladder_sizes(batch)
        self.building = BatchGraphs("tree", sizes, self._build)
        self.acceptance = BatchGraphs("tree acceptance", sizes, self._accept)
        self._eager_tree: tuple[torch.Tensor, ...] | None = None
        self.fuse = False  # a lone request's graphed pieces compiled (`attention.fused`; set by `capture`)

    def nodes_at(self, size: int) -> int:
        """Draft nodes per request of a tree step of `size` requests (a captured rung, or the batch)."""
        return self.runner.tree_q(size) - 1

    def nodes_for(self, batch: int) -> int:
        return self.nodes_at(self.building.rung_for(batch) or batch)

    def overhead_seconds(self, rung: int) -> float:
        """GPU seconds a tree step of `rung` requests spends beyond its verify and draft: building the tree,
        accepting and moving K/V (their graphs' replays, measured after capture)."""
        return sum(graphs.replay_seconds(rung) for graphs in (self.building, self.acceptance))

    def capture(self) -> float:
        # compiled in the warm-ups of the captures below, never mid-run: steps without graphs run as written
        self.fuse = fusing(self.runner.device)
        # capturing (and measuring) the acceptance runs its K/V moves: from slots of the scratch page alone
        self.runner.tree_slots[0] = self.runner.kv.scratch_page
        self.runner.tree_slots[1] = 0
        return self.building.capture() + self.acceptance.capture()

    # ---- the graphed pieces ------------------------------------------------------------------
    def _fuses(self, size: int) -> bool:
        """Whether the graphed pieces of `size` requests run fused kernels (`attention.fused`): a lone request's, the
        one shape whose compile start-up pays for, where a tree step's small kernels weigh most."""
        return size == 1 and self.fuse

    def _build(self, size: int) -> tuple[torch.Tensor, ...]:
        logprobs, tokens = (c[:size] for c in self.candidates)
        nodes = self.nodes_at(size)
        # the possible nodes' tables (cached per shape) made here, outside a compiled building: their copies to the
        # device run before the graph's capture, not in it. Trees too large for them go depth by depth, as written
        possible = possible_nodes(*logprobs.shape[1:], nodes, logprobs.device)
        build = fused_if(build_trees, self._fuses(size) and possible is not None)
        self._eager_tree = build(logprobs, tokens, nodes, possible=possible)
        return self._eager_tree

    def _accept(self, size: int) -> tuple[torch.Tensor, ...]:
        """The accepted path, its length and the bonus, the path's tokens, and how many drafts the chain (each
        position's first candidate) would have had accepted (`accept_trees`). The path's K/V move into place on
        the way."""
        *fields, mask, _ = (t[:size] for t in self.building.outputs.get(size, self._eager_tree))
        nodes = fields[0].shape[1] + 1
        accept = fused_if(accept_trees, self._fuses(size))
        path, accepted, bonus, path_tokens, chain, accepted_steps = accept(
            *fields, mask, self.chosen[:size * nodes].view(size, nodes), self.depth)
        self._move_into_place(path, accepted_steps, nodes)
        return path, accepted, bonus, path_tokens, chain

    def _move_into_place(self, path: torch.Tensor, accepted_steps: torch.Tensor, nodes: int) -> None:
        """The accepted nodes' K/V from their slots (start + node id) to the path's (start + depth), for every
        request and layer at once. The slots are the verify's own write slots (`TargetRunner.tree_slots`: node j of
        request i at row i * nodes + j), so nothing of it comes from the host. Moves past a request's accepted count
        (and a graph rung's padding requests) copy the scratch page's first slot onto itself."""
        batch, depth = path.shape
        slots = self.runner.tree_slots[:, :batch * nodes].view(2, batch, nodes)
        source = slots.gather(2, path[None].expand(2, batch, depth))
        # the path's d-th draft goes to node d's slot (start + d); a tree of fewer nodes than the block's positions
        # has no path that deep, and those moves (any slot of the request's) are parked below
        destination = slots[:, :, 1:depth + 1] if nodes > depth else \
            slots[:, :, torch.arange(1, depth + 1, device=path.device).clamp(max=nodes - 1)]
        pages, offsets = ([torch.where(accepted_steps, s[i], fill).flatten() for s in (source, destination)]
                          for i, fill in ((0, self.runner.kv.scratch_page), (1, 0)))
        self.runner.kv.move_rows(pages[0], offsets[0], pages[1], offsets[1])  # one copy per cache dtype

    # ---- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        batch = len(running)
        # drafts first: the drafter reads the last step's features, which this step's forwards overwrite
        for buffer, candidates in zip(self.candidates, self.drafter.propose_candidates(running)):
            buffer[:batch].copy_(candidates)
        # a lone request's tree whose rows would straddle a KV chunk boundary: its first candidates alone, one chain,
        # whose shape the host knows, so its node rows replay the graph (any other shape there runs eagerly)
        chain_shaped = batch == 1 and self.runner.lone_tree_declined([running[0].target_pages], self.nodes_for(1) + 1)
        if chain_shaped:
            self.candidates[0][:1, :, 1:] = NOT_A_CANDIDATE
        tokens, _, depths, _, _, masks, packed = self.building.run(batch)
        rung = self.building.rung_for(batch)
        if rung is not None:  # every row of the rung: a verify replayed at that rung reads its padding rows' too
            packed = self.building.outputs[rung][-1]
        nodes = tokens.shape[1] + 1
        self.verify_length = nodes
        starts = [r.num_cached for r in running]
        out = self.runner.run_tree([r.target_pages for r in running], [r.pending_token for r in running],
                                   TreeRows(tokens, depths, masks, packed.view(-1), chain_shaped))
        self.chosen[:batch * nodes].copy_(sample_block(out, running, nodes).view(-1))
        path, accepted, bonus, path_tokens, chain = self.acceptance.run(batch)
        # the anchor's and the path's features, request i's at rows i * block_size on: gathered before the
        # chunks' forward (if any) overwrites the buffer's first rows
        block = self.drafter.block_size
        source_rows = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1) + (
            torch.arange(batch, device=path.device)[:, None] * nodes)
        chunk_rows = self.runner.run_prefill_after(prefill, out.features[source_rows.flatten()])
        # the step's tokens on their way to the host, then the next step's draft with candidates: reading them waits
        # for this step alone, and the GPU drafts while the host commits (not with prompt chunks in the step: their
        # requests' contexts are written after it)
        transfer = StepTransfer(torch.cat([path_tokens, accepted[:, None], bonus[:, None], chain[:, None]], dim=1),
                                prefill)
        ahead = self.draft_ahead and prefill is None and self.drafter.propose_next(
            running, bonus, accepted + 1, [i * block for i in range(batch)], [block] * batch, candidates=True)
        host = transfer.read()
        committed, counts = [], []
        self.chain_accepted = [row[self.depth + 2] for row in host]
        for row, request, start in zip(host, running, starts):
            a = row[self.depth]
            committed.append(row[:a] + [row[self.depth + 1]])
            counts.append(a + 1)
            # the cache ends after the accepted path; the pages of a block past it stay for the next step
            request.target_pages.truncate(start + a + 1, room=self.tokens_per_step)
        if ahead:
            self.drafter.settle(running, counts)
        else:
            self.drafter.extend(running, self.runner.features_out, [chunk_rows + i * block for i in range(batch)],
                                counts)
        return committed

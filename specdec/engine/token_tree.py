"""A token tree per request from the drafter's block distributions, built and accepted with tensor ops.

    tree = TokenTree.build(logprobs, tokens, budget)   # [B, n, k]: each position's top-k, best first
    mask = tree.attention_mask()                        # [B, N+1, N+1]: a node sees its ancestors and itself
    path, accepted, bonus = tree.accept(target_tokens)  # target_tokens [B, N+1]: its choice after each node

Node 0 is the anchor (the request's last committed token); nodes 1..N are drafts. DFlash predicts every
block position from the anchor and the context alone, so the candidates below any node at depth d are
the top-k tokens of position d + 1, and a node's score is the sum of the log-probabilities of the tokens
on its path. The tree is the `budget` best-scoring nodes. A prefix scores at least what its extension
does, so the chosen set is closed under prefixes: a tree. It is built with a fixed number of small tensor
operations, so the step builds it on the GPU, inside a CUDA graph, with no host work that grows with the tree;
there each kernel costs its launch (~2-3 us) or more, so their number is what a tree's building costs.

Which nodes can be among the best is known before any score: replacing a node's draft of rank > 0 at some depth
with that position's first candidate gives a node scoring at least as much, so a node whose path leaves the first
candidates at m positions comes with the 2^m - 1 nodes of the other choices there, and all their ancestors. A node
whose union of such paths has more than `budget` nodes is never chosen. For the small trees of a lone request (15
nodes: 633 possible nodes of the 4^1 + ... + 4^15) the step scores every possible node at once (`possible_nodes`,
a table made once per shape) and takes the best: ~23 kernels, where building it depth by depth takes ~60, among them
a top-k per depth (~9 us each on an H200 at 63 nodes). Larger trees keep the best `budget` of each depth, depth by
depth (a node of the overall best has its parent among its depth's best).

Node order: by score, best first, so every parent comes before its children (a key that drops by a
hair per depth breaks ties between a node and its child, which a draft of probability 1 would make).
Acceptance walks the tree as the chain is walked: a node is accepted when its token is the target's
choice after its parent and its parent was accepted; among the children of a node at most one can be
(their tokens differ), so the accepted nodes form one path from the anchor. The bonus is the target's
choice after the deepest accepted node. With k = 1 and budget n the tree is the chain.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

DEPTH_TIEBREAK = 1e-4  # subtracted per depth from a node's score: a child never outranks its parent


@dataclass
class TokenTree:
    tokens: torch.Tensor  # [B, N] int64: the draft token of nodes 1..N
    parents: torch.Tensor  # [B, N] int64: each node's parent, 0 (the anchor) .. N - 1; parents precede children
    depths: torch.Tensor  # [B, N] int64: 1 .. n
    scores: torch.Tensor  # [B, N]: sum of the path's log-probabilities
    ranks: torch.Tensor  # [B, N] int64: the node's token's rank among its position's candidates (0: the chain's)
    max_depth: int  # n, the block's draft positions

    @classmethod
    def build(cls, logprobs: torch.Tensor, tokens: torch.Tensor, budget: int, at_once: bool = True,
              possible: PossibleNodes | None = None) -> TokenTree:
        """logprobs, tokens: [B, n, k], each position's top-k candidates (logprobs descending). A fixed
        number of kernels (a step replays them from a CUDA graph, where each costs a launch). `at_once`: among every
        possible node where their tables are small enough (see the module's doc; `possible`: the tables, if made
        already), else depth by depth; the same tree either way."""
        batch, n, k = logprobs.shape
        if budget < 1:
            raise ValueError(f"a tree needs at least one node, got a budget of {budget}")
        if possible is None and at_once:
            possible = possible_nodes(n, k, budget, logprobs.device)
        key, depths, ranks, places, parents = (_scored_possible_nodes(logprobs, possible) if possible is not None
                                               else _beam_nodes(logprobs, budget))
        size = min(budget, key.shape[1])
        _, selected = key.topk(size, dim=1)  # best first: parents before children
        # candidate index -> node id (1..size), the anchor's index (the last) -> 0; candidates left out are never a
        # chosen node's parent
        node_of = torch.zeros(batch, key.shape[1] + 1, dtype=torch.long, device=logprobs.device)
        node_of.scatter_(1, selected, torch.arange(1, size + 1, device=logprobs.device).expand(batch, size))
        depths, ranks, places, parents = (t.expand(batch, -1).gather(1, selected)
                                          for t in (depths, ranks, places, parents))
        return cls(tokens.flatten(1).gather(1, places), node_of.gather(1, parents), depths,
                   key.gather(1, selected) + DEPTH_TIEBREAK * depths, ranks, n)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def _with_anchor(self, values: torch.Tensor, anchor_value: int) -> torch.Tensor:
        return torch.cat([torch.full_like(values[:, :1], anchor_value), values], dim=1)

    def attention_mask(self) -> torch.Tensor:
        """[B, N+1, N+1] bool: row i (node i, 0 the anchor) sees column j iff j is i or an ancestor of i. By pointer
        doubling: after pass t a row holds its ancestors up to 2^t - 1 generations up and `jump` is each node's
        ancestor 2^t up, so log2 of the depth passes of three kernels each (one pass per generation took two)."""
        jump = self._with_anchor(self.parents, 0)  # one generation up; the anchor is its own parent
        batch, nodes = jump.shape
        mask = torch.eye(nodes, dtype=torch.bool, device=jump.device).expand(batch, nodes, nodes)
        for _ in range(max(self.max_depth, 1).bit_length()):  # 2^passes - 1 >= max_depth generations
            mask = mask | mask.gather(1, jump[:, :, None].expand(batch, nodes, nodes))
            jump = jump.gather(1, jump)
        return mask

    def accept(self, target_tokens: torch.Tensor, mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target_tokens [B, N+1]: the target's token after the anchor (0) and after each node; `mask` the
        tree's `attention_mask()` if already made. Returns (path [B, n] node ids of the accepted drafts, root
        first, padded with 0; accepted [B], the number of accepted drafts; bonus [B], the target's token
        after the last accepted node). A node is accepted when it and every ancestor match the target's
        choice at their parents: a few batched kernels, no loop over depths."""
        mask = self.attention_mask() if mask is None else mask
        batch, nodes = target_tokens.shape
        matches = self._with_anchor(self.tokens == target_tokens.gather(1, self.parents), 1).bool()
        accepted_node = ~(mask & ~matches[:, None, :]).any(dim=2)
        depths = self._with_anchor(self.depths, 0)
        deepest = torch.where(accepted_node, depths, -1).argmax(dim=1)  # one accepted path: its end
        accepted = depths.gather(1, deepest[:, None]).squeeze(1)
        bonus = target_tokens.gather(1, deepest[:, None]).squeeze(1)
        # the path: the deepest accepted node's ancestors, each at its depth (the anchor and the rest of the
        # tree go to a dropped column)
        on_path = mask.gather(1, deepest[:, None, None].expand(batch, 1, nodes)).squeeze(1)
        column = torch.where(on_path & (depths > 0), depths - 1, self.max_depth)
        path = torch.zeros(batch, self.max_depth + 1, dtype=torch.long, device=target_tokens.device)
        path.scatter_(1, column, torch.arange(nodes, device=target_tokens.device).expand(batch, nodes))
        return path[:, :self.max_depth], accepted, bonus


# the most possible nodes a request's tree is built from at once (`possible_nodes`); larger trees go depth by depth.
# A block of 16, 4 candidates a position: 633 for 15 nodes (a lone request's), 9,609 for 31, 122,865 for 63
POSSIBLE_NODES_MAX = 16384


class PossibleNodes(NamedTuple):
    """Every node that may be among a tree's best (see the module's doc), as tables over them (P nodes)."""

    depths: torch.Tensor  # [P]
    # the flat index (depth * k + rank, into a row of n * k + 1 whose last entry is 0) of each position where the
    # node's path leaves the first candidates, padded with that last entry
    departures: torch.Tensor  # [P, m]
    ranks: torch.Tensor  # [P]: the node's own token's rank
    places: torch.Tensor  # [P]: its token's index among the candidates, (depth - 1) * k + rank
    parents: torch.Tensor  # [P]: its parent's index, P for the anchor
    sums: torch.Tensor  # [P]: depth - 1, where the first candidates' sum to its depth sits (made once, not per step)


@functools.lru_cache(maxsize=64)
def possible_nodes(n: int, k: int, budget: int, device: torch.device) -> PossibleNodes | None:
    """The nodes of depth <= n, k candidates a position, that a tree of `budget` nodes may hold, parents before
    children; None where there are more than POSSIBLE_NODES_MAX. Made once per shape, before a CUDA graph is captured
    (its warm-up run builds the same tree): no host-to-device copy runs inside the capture."""
    index: dict[tuple[int, ...], int] = {}
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(n):
        frontier = [(*path, rank) for path in frontier for rank in range(k)
                    if _nodes_it_brings((*path, rank)) <= budget]
        for path in frontier:
            index[path] = len(paths)
            paths.append(path)
        if len(paths) > POSSIBLE_NODES_MAX:
            return None
    departures = [[d * k + r for d, r in enumerate(path) if r] for path in paths]
    width = max(1, *map(len, departures))
    depths = torch.tensor([len(path) for path in paths])
    tables = PossibleNodes(
        depths, torch.tensor([d + [n * k] * (width - len(d)) for d in departures]),
        torch.tensor([path[-1] for path in paths]), torch.tensor([(len(path) - 1) * k + path[-1] for path in paths]),
        torch.tensor([index.get(path[:-1], len(paths)) for path in paths]), depths - 1)
    return PossibleNodes(*(t.to(device) for t in tables))


def _nodes_it_brings(ranks: tuple[int, ...]) -> int:
    """How many nodes a tree holding the node of this path of ranks holds at least: at each depth, one per choice
    (that rank or the first) at the positions so far where the path leaves the first candidates."""
    total, departed = 0, 0
    for rank in ranks:
        departed += rank > 0
        total += 2 ** departed
    return total


def _scored_possible_nodes(logprobs: torch.Tensor, possible: PossibleNodes) -> tuple[torch.Tensor, ...]:
    """Every possible node's key (its path's log-probabilities less the depth's tiebreak: the first candidates' sum
    to its depth, each less the tiebreak, plus what each departure from them loses), depth, rank, place and parent
    (`PossibleNodes`)."""
    batch = logprobs.shape[0]
    firsts = (logprobs[:, :, 0] - DEPTH_TIEBREAK).cumsum(dim=1)
    losses = torch.cat([(logprobs - logprobs[:, :, :1]).flatten(1), firsts.new_zeros(batch, 1)], dim=1)
    key = firsts[:, possible.sums] + losses[:, possible.departures].sum(dim=2)
    return key, possible.depths, possible.ranks, possible.places, possible.parents


def _beam_nodes(logprobs: torch.Tensor, budget: int) -> tuple[torch.Tensor, ...]:
    """Each depth's best `budget` extensions of the last depth's, depth by depth: the candidates' keys, depths, ranks,
    places and parents as `_scored_possible_nodes` gives them."""
    batch, n, k = logprobs.shape
    keys, chosen_all, widths = [], [], []
    beam_key = torch.zeros(batch, 1, dtype=logprobs.dtype, device=logprobs.device)  # the anchor
    steps = logprobs - DEPTH_TIEBREAK  # once for every depth: each kernel of the loop costs a launch n times
    # per depth: the key of every extension of the beam by each of position d's candidates, the best `budget` kept;
    # chosen = parent's index in the beam * k + the candidate's rank. A beam in any order serves (its nodes are ranked
    # at the end), and an unsorted top-k skips a sort kernel per depth
    for d in range(n):
        key = (beam_key[:, :, None] + steps[:, d, None, :]).flatten(1)
        beam_key, chosen = key.topk(min(budget, key.shape[1]), dim=1, sorted=False)
        keys.append(beam_key)
        chosen_all.append(chosen)
        widths.append(beam_key.shape[1])
    key, chosen = torch.cat(keys, dim=1), torch.cat(chosen_all, dim=1)
    depth_of, parent_offset = _candidate_layout(tuple(widths), logprobs.device)
    rank, parent_in_beam = chosen % k, chosen // k
    parent = torch.where(depth_of > 1, parent_offset[(depth_of - 1).clamp(max=n - 1)] + parent_in_beam,
                         key.shape[1])
    return key, depth_of, rank, (depth_of - 1) * k + rank, parent


@functools.lru_cache(maxsize=64)
def _candidate_layout(widths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For candidates concatenated depth by depth (`widths[d]` at depth d + 1): each one's depth, and each
    depth's offset among them (index d: depth d + 1's start). Made once per shape, before a CUDA graph is
    captured (its warm-up run builds the same tree): no host-to-device copy runs inside the capture."""
    depth_of = torch.repeat_interleave(torch.arange(1, len(widths) + 1), torch.tensor(widths))
    offsets = torch.tensor([0, *itertools.accumulate(widths)][:len(widths)])
    return depth_of.to(device), torch.cat([offsets[:1], offsets[:-1]]).to(device)

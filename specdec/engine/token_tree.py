"""A token tree per request from the drafter's block distributions, built and accepted with tensor ops.

    tree = TokenTree.build(logprobs, tokens, budget)   # [B, n, k]: each position's top-k, best first
    mask = tree.attention_mask()                        # [B, N+1, N+1]: a node sees its ancestors and itself
    path, accepted, bonus = tree.accept(target_tokens)  # target_tokens [B, N+1]: its choice after each node

Node 0 is the anchor (the request's last committed token); nodes 1..N are drafts. DFlash predicts every
block position from the anchor and the context alone, so the candidates below any node at depth d are
the top-k tokens of position d + 1, and a node's score is the sum of the log-probabilities of the tokens
on its path. The tree is the `budget` best-scoring nodes. A prefix scores at least what its extension
does, so the chosen set is closed under prefixes: a tree. It is built depth by depth, keeping the best
`budget` nodes of each depth (a node of the overall best has its parent among its depth's best), then
the best `budget` of all: a fixed number of small tensor operations (n of them), so the step builds
it on the GPU, inside a CUDA graph, with no host work that grows with the tree.

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
    def build(cls, logprobs: torch.Tensor, tokens: torch.Tensor, budget: int) -> TokenTree:
        """logprobs, tokens: [B, n, k], each position's top-k candidates (logprobs descending). A fixed
        number of kernels per depth (a step replays them from a CUDA graph, where each costs a launch)."""
        batch, n, k = logprobs.shape
        if budget < 1:
            raise ValueError(f"a tree needs at least one node, got a budget of {budget}")
        device = logprobs.device
        keys, chosen_all, widths = [], [], []
        beam_key = torch.zeros(batch, 1, dtype=logprobs.dtype, device=device)  # the anchor
        steps = logprobs - DEPTH_TIEBREAK  # once for every depth: each kernel of the loop costs a launch n times
        # per depth: the key of every extension of the beam by each of position d's candidates, the best
        # `budget` kept; chosen = parent's index in the beam * k + the candidate's rank. A beam in any order serves
        # (its nodes are ranked at the end), and an unsorted top-k skips a sort kernel per depth
        for d in range(n):
            key = (beam_key[:, :, None] + steps[:, d, None, :]).flatten(1)
            beam_key, chosen = key.topk(min(budget, key.shape[1]), dim=1, sorted=False)
            keys.append(beam_key)
            chosen_all.append(chosen)
            widths.append(beam_key.shape[1])
        key, chosen = torch.cat(keys, dim=1), torch.cat(chosen_all, dim=1)
        depth_of, parent_offset = _candidate_layout(tuple(widths), device)
        rank, parent_in_beam = chosen % k, chosen // k
        # a candidate's parent among all candidates (-1: the anchor)
        parent_global = torch.where(depth_of > 1, parent_offset[(depth_of - 1).clamp(max=n - 1)] + parent_in_beam, -1)
        size = min(budget, key.shape[1])
        _, selected = key.topk(size, dim=1)  # best first: parents before children
        # candidate index -> node id (1..size); candidates left out -> -1
        node_of = torch.full((batch, key.shape[1]), -1, dtype=torch.long, device=device)
        node_of.scatter_(1, selected, torch.arange(1, size + 1, device=device).expand(batch, size))
        parent = parent_global.gather(1, selected)
        parents = torch.where(parent < 0, 0, node_of.gather(1, parent.clamp(min=0)))
        depths = depth_of.expand(batch, -1).gather(1, selected)
        ranks = rank.gather(1, selected)
        picked = tokens.flatten(1).gather(1, (depths - 1) * k + ranks)
        return cls(picked, parents, depths, key.gather(1, selected) + DEPTH_TIEBREAK * depths, ranks, n)

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


@functools.lru_cache(maxsize=64)
def _candidate_layout(widths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For candidates concatenated depth by depth (`widths[d]` at depth d + 1): each one's depth, and each
    depth's offset among them (index d: depth d + 1's start). Made once per shape, before a CUDA graph is
    captured (its warm-up run builds the same tree): no host-to-device copy runs inside the capture."""
    depth_of = torch.repeat_interleave(torch.arange(1, len(widths) + 1), torch.tensor(widths))
    offsets = torch.tensor([0, *itertools.accumulate(widths)][:len(widths)])
    return depth_of.to(device), torch.cat([offsets[:1], offsets[:-1]]).to(device)

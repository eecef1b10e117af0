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

from dataclasses import dataclass

import torch

DEPTH_TIEBREAK = 1e-4  # subtracted per depth from a node's score: a child never outranks its parent


@dataclass
class TokenTree:
    tokens: torch.Tensor  # [B, N] int64: the draft token of nodes 1..N
    parents: torch.Tensor  # [B, N] int64: each node's parent, 0 (the anchor) .. N - 1; parents precede children
    depths: torch.Tensor  # [B, N] int64: 1 .. n
    scores: torch.Tensor  # [B, N]: sum of the path's log-probabilities
    max_depth: int  # n, the block's draft positions

    @classmethod
    def build(cls, logprobs: torch.Tensor, tokens: torch.Tensor, budget: int) -> TokenTree:
        """logprobs, tokens: [B, n, k], each position's top-k candidates (logprobs descending)."""
        batch, n, k = logprobs.shape
        if budget < 1:
            raise ValueError(f"a tree needs at least one node, got a budget of {budget}")
        arange = torch.arange(batch, device=logprobs.device)[:, None]
        scores, keys, depths, parent_ids, node_tokens = [], [], [], [], []
        beam_key = torch.zeros(batch, 1, dtype=logprobs.dtype, device=logprobs.device)  # the anchor
        beam_score = beam_key.clone()
        beam_global = torch.full((batch, 1), -1, dtype=torch.long, device=logprobs.device)
        offset = 0  # candidates collected so far (the anchor is not one)
        for d in range(n):
            # every node of the beam extended by each of position d's candidates
            score = (beam_score[:, :, None] + logprobs[:, d, None, :]).flatten(1)
            key = (beam_key[:, :, None] + logprobs[:, d, None, :] - DEPTH_TIEBREAK).flatten(1)
            keep = min(budget, key.shape[1])
            key, chosen = key.topk(keep, dim=1)
            parent_in_beam, rank = chosen // k, chosen % k
            scores.append(score.gather(1, chosen))
            keys.append(key)
            depths.append(torch.full_like(chosen, d + 1))
            parent_ids.append(beam_global.gather(1, parent_in_beam))
            node_tokens.append(tokens[:, d][arange, rank])
            beam_key, beam_score = key, scores[-1]
            beam_global = offset + torch.arange(keep, device=logprobs.device).expand(batch, keep)
            offset += keep
        key = torch.cat(keys, dim=1)
        size = min(budget, key.shape[1])
        _, selected = key.topk(size, dim=1)  # best first: parents before children
        # candidate index -> node id (1..size); candidates left out -> -1
        node_of = torch.full((batch, key.shape[1]), -1, dtype=torch.long, device=key.device)
        node_of.scatter_(1, selected, torch.arange(1, size + 1, device=key.device).expand(batch, size))
        parent_global = torch.cat(parent_ids, dim=1).gather(1, selected)
        parents = torch.where(parent_global < 0, 0, node_of.gather(1, parent_global.clamp(min=0)))
        return cls(torch.cat(node_tokens, dim=1).gather(1, selected), parents,
                   torch.cat(depths, dim=1).gather(1, selected), torch.cat(scores, dim=1).gather(1, selected), n)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def _with_anchor(self, values: torch.Tensor, anchor_value: int) -> torch.Tensor:
        return torch.cat([torch.full_like(values[:, :1], anchor_value), values], dim=1)

    def attention_mask(self) -> torch.Tensor:
        """[B, N+1, N+1] bool: row i (node i, 0 the anchor) sees column j iff j is i or an ancestor of i."""
        parents = self._with_anchor(self.parents, 0)  # the anchor is its own parent
        batch, nodes = parents.shape
        rows = torch.arange(nodes, device=parents.device)
        mask = torch.zeros(batch, nodes, nodes, dtype=torch.bool, device=parents.device)
        ancestor = rows.expand(batch, nodes)
        for _ in range(self.max_depth + 1):  # itself, then one generation up per pass (the anchor repeats)
            mask.scatter_(2, ancestor[:, :, None], True)
            ancestor = parents.gather(1, ancestor)
        return mask

    def accept(self, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """target_tokens [B, N+1]: the target's token after the anchor (0) and after each node.
        Returns (path [B, n] node ids of the accepted drafts, root first, padded with 0; accepted [B], the
        number of accepted drafts; bonus [B], the target's token after the last accepted node)."""
        parents = self._with_anchor(self.parents, 0)
        matches = self._with_anchor(self.tokens == target_tokens.gather(1, self.parents), 1).bool()
        accepted_node = matches.clone()
        for _ in range(self.max_depth):  # a node is accepted when it and all its ancestors match
            accepted_node = matches & accepted_node.gather(1, parents)
        depths = self._with_anchor(self.depths, 0)
        deepest = torch.where(accepted_node, depths, -1).argmax(dim=1)  # one accepted path: its end
        accepted = depths.gather(1, deepest[:, None]).squeeze(1)
        bonus = target_tokens.gather(1, deepest[:, None]).squeeze(1)
        # the path from its end up, written from the deepest position back to the first
        path = torch.zeros(self.tokens.shape[0], self.max_depth, dtype=torch.long, device=self.tokens.device)
        node = deepest
        for _ in range(self.max_depth):
            depth = depths.gather(1, node[:, None]).squeeze(1)
            slot = (depth - 1).clamp(min=0)
            path.scatter_(1, slot[:, None], torch.where(depth > 0, node, path.gather(1, slot[:, None]).squeeze(1))[:, None])
            node = parents.gather(1, node[:, None]).squeeze(1)
        return path, accepted, bonus

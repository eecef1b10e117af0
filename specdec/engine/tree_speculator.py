"""The speculative decode phase with a token tree per request (verify="tree"; the torch attention backend).

    candidates = drafter.propose_candidates(batch, k)   # each block position's top-k drafts, log-probabilities
    tree       = TokenTree.build(candidates, budget)    # the best `budget` nodes per request
    verify     = target([anchor, nodes...])             # one forward: each node sees the context, its ancestors
                                                        # and itself, at the anchor's position plus its depth
    path, a, bonus = tree.accept(target tokens)         # greedy argmax or the target's sample at every node
    K/V of the accepted path move into place (start + 1 .. start + a); the rest of the tree goes back;
    the drafter's context grows by the features of the anchor and the accepted path.

Sampling stays lossless as on the chain: a node is kept only when its token equals the target's own
draw at its parent, and each node's draw is the target's at a prefix that is exactly the committed text
(the draft candidates are one-hot choices, as the chain's drafts are). Prompt chunks of the step run in
a forward of their own first (a tree's mask is not a prompt chunk's).
"""

from __future__ import annotations

import numpy as np
import torch

from attention.transfer import upload
from specdec.engine.drafter import Drafter
from specdec.engine.request import Request
from specdec.engine.sampler import sample_block
from specdec.engine.token_tree import TokenTree
from specdec.runtime.target_runner import BlockOutput, PrefillChunks, TargetRunner

CANDIDATES_PER_POSITION = 4


class TreeDecoding:
    def __init__(self, runner: TargetRunner, drafter: Drafter, budget: int):
        self.runner = runner
        self.drafter = drafter
        self.budget = budget
        self.tokens_per_step = drafter.block_size  # the most a step commits per request (a path of bs - 1 + bonus)
        self.verify_length = budget + 1  # tokens per request each step verifies: the anchor and the nodes

    @torch.no_grad()
    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        # drafts first: the drafter reads the last step's features, which the chunks' forward overwrites
        candidates = self.drafter.propose_candidates(running, CANDIDATES_PER_POSITION) if running else None
        chunk_rows = 0
        if prefill is not None:  # the chunks in a forward of their own; their features take the buffer's first rows
            self.runner.run_prefill(prefill)
            prefill.read_first_tokens()
            chunk_rows = sum(prefill.lens)
        if not running:
            return []
        tree = TokenTree.build(*candidates, self.budget)
        nodes = tree.size + 1
        starts = np.array([r.num_cached for r in running], dtype=np.int64)
        anchors = torch.tensor([r.pending_token for r in running], dtype=torch.long, device=tree.tokens.device)
        ids = torch.cat([anchors[:, None], tree.tokens], dim=1).flatten()
        depths = np.concatenate([np.zeros((len(running), 1), np.int64), tree.depths.cpu().numpy()], axis=1)
        out = self.runner.forward([r.target_pages for r in running], ids, [nodes] * len(running),
                                  logits_rows=upload(np.arange(len(ids), dtype=np.int64), self.runner.device),
                                  feature_layers=self.drafter.target_layer_ids,
                                  positions=(starts[:, None] + depths).reshape(-1),
                                  query_masks=tree.attention_mask().cpu().numpy())
        block = BlockOutput(out.logits, out.logits.argmax(dim=-1), None)  # as a block step's output reads
        chosen = sample_block(block, running, nodes).view(len(running), nodes)
        path, accepted, bonus = tree.accept(chosen)
        host_path, host_accepted, host_bonus = path.tolist(), accepted.tolist(), bonus.tolist()
        tokens = tree.tokens.tolist()
        committed, counts, moves, sources = [], [], [], []
        for i, request in enumerate(running):
            kept = host_path[i][:host_accepted[i]]  # node ids, 1-based
            committed.append([tokens[i][node - 1] for node in kept] + [host_bonus[i]])
            counts.append(len(kept) + 1)
            start, table = int(starts[i]), request.target_pages
            # the accepted nodes' K/V go from their slots (start + node id) to the path's (start + depth)
            moves.append((table, start + np.array(kept, dtype=np.int64), start + 1 + np.arange(len(kept))))
            sources += [i * nodes] + [i * nodes + node for node in kept]  # the anchor's and the path's features
        self._move_into_place(moves)
        for request, start, count in zip(running, starts.tolist(), counts):
            request.target_pages.truncate(start + count)  # the cache ends after the accepted path
        # the features the drafter's context takes, contiguous after the chunks' rows
        features = self.runner.features_out
        features[chunk_rows:chunk_rows + len(sources)] = out.features[upload(np.array(sources, dtype=np.int64),
                                                                             features.device)].to(features.dtype)
        rows = (chunk_rows + np.concatenate([[0], np.cumsum(counts)[:-1]])).tolist()
        self.drafter.extend(running, features, rows, counts)
        return committed

    def _move_into_place(self, moves: list[tuple]) -> None:
        """Every request's (table, source positions, destination positions) K/V in one copy per layer."""
        places = [(table.array[positions // self.runner.page_size], positions % self.runner.page_size)
                  for table, src, dst in moves for positions in (src, dst)]
        if not any(len(pages) for pages, _ in places):
            return
        src = [np.concatenate(parts) for parts in zip(*places[0::2])]
        dst = [np.concatenate(parts) for parts in zip(*places[1::2])]
        device = self.runner.device
        self.runner.kv.move_rows(*(upload(a.astype(np.int64), device) for a in (*src, *dst)))


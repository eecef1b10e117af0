"""One speculative step for the running batch: draft, verify, accept, roll back.

    drafts  = drafter.propose(batch)                  # [B, bs-1], one drafter forward
    verify  = target([anchor, drafts...]) per request  # one causal forward, bs queries each
    a, bonus = accept(drafts, target tokens)          # greedy argmax or the target's samples
    commit drafts[:a] + [bonus]; target cache -> start + a + 1 (whole tail pages back to the pool);
    the drafter's context grows by the features of positions start .. start + a.

One device-to-host transfer per step (drafts, a and bonus together).
"""

from __future__ import annotations

import torch

from drafters.base import Drafter
from specdec.acceptance import accept
from specdec.request import Request


class Speculator:
    """Holds the drafter, not the engine: the engine passes itself to each step, so the two never
    form a reference cycle and a dropped engine frees its GPU memory at once."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.block_size = drafter.block_size

    @torch.no_grad()
    def step(self, engine, running: list[Request], on_commit) -> None:
        bs, batch = self.block_size, len(running)
        drafts = self.drafter.propose(running)  # [B, bs-1]
        anchors = engine.ids_tensor([r.pending_token for r in running])
        block = torch.cat([anchors[:, None], drafts], dim=1)  # [B, bs]
        starts = [r.num_cached for r in running]
        out = engine.forward_tokens(running, block.flatten(), [bs] * batch,
                                    logits_rows=torch.arange(batch * bs, device=engine.device),
                                    feature_layers=self.drafter.target_layer_ids)
        target_tokens = engine.sample(out.logits, running, [bs] * batch).view(batch, bs)
        accepted, bonus = accept(drafts, target_tokens)
        host = torch.cat([drafts, accepted[:, None], bonus[:, None]], dim=1).tolist()
        features = out.features.view(batch, bs, -1)
        extended, new_features = [], []
        for i, (request, start) in enumerate(zip(running, starts)):
            a, tokens = host[i][bs - 1], host[i][:host[i][bs - 1]] + [host[i][bs]]
            taken = request.commit_many(tokens)
            # what the step committed: a + 1, or less when EOS / a stop / max_new_tokens cut it short
            request.stats.acceptance_lengths.append(taken)
            on_commit(request, tokens[:taken])
            if request.finished:
                continue  # its pages go back when it is retired
            # keep K/V of the anchor and the accepted drafts; the bonus is the new pending token
            request.target_pages.truncate(start + a + 1)
            extended.append(request)
            new_features.append(features[i, :a + 1])
        if extended:
            self.drafter.extend(extended, new_features)

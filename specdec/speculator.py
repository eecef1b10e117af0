"""One speculative step for the running batch: draft, verify, accept, roll back.

    drafts  = drafter.propose(batch)                  # [B, bs-1], one drafter forward
    verify  = target([anchor, drafts...]) per request  # one causal forward, bs queries each (CUDA graphs)
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
        starts = [r.num_cached for r in running]
        drafts = self.drafter.propose(running)  # [B, bs-1] on the device
        out = engine.runner.run_block([r.target_pages for r in running], [r.pending_token for r in running], drafts, bs)
        target_tokens = engine.sample(out, running, bs).view(batch, bs)
        accepted, bonus = accept(drafts, target_tokens)
        # the step's one device-to-host transfer
        host = torch.cat([drafts, accepted[:, None].long(), bonus[:, None]], dim=1).tolist()
        extended, rows, counts = [], [], []
        for i, (request, start) in enumerate(zip(running, starts)):
            a, tokens = host[i][bs - 1], host[i][:host[i][bs - 1]] + [host[i][bs]]
            taken = engine.commit(request, tokens, on_commit)
            # what the step committed: a + 1, or less when EOS / a stop / max_new_tokens cut it short
            if taken:  # 0: the request failed alone while committing
                request.stats.acceptance_lengths.append(taken)
            if request.finished:
                continue  # its pages go back when it is retired
            # keep K/V of the anchor and the accepted drafts; the bonus is the new pending token
            request.target_pages.truncate(start + a + 1)
            extended.append(request)
            rows.append(i)
            counts.append(a + 1)
        if extended:
            self.drafter.extend(extended, out.features, rows, counts)

"""The speculative decode phase: draft, verify, accept, roll back, for the whole running batch.

    drafts  = drafter.propose(batch)                  # [B, bs-1], one drafter forward
    verify  = target([anchor, drafts...]) per request  # one causal forward, bs queries each (CUDA graphs)
    a, bonus = accept(drafts, target tokens)          # greedy argmax or the target's samples
    tokens  = drafts[:a] + [bonus]; target cache -> start + a + 1 (whole tail pages back to the pool);
    the drafter's context grows by the features of positions start .. start + a.

One device-to-host transfer per step (drafts, a and bonus together). The engine commits the tokens;
one it cuts short (EOS, a stop, max_new_tokens) finishes the request, which then gives back its
target pages and drafter state, so the rollback and the drafter's context need not wait for it.
"""

from __future__ import annotations

import torch

from specdec.engine.acceptance import accept
from specdec.engine.decoding import to_host
from specdec.engine.drafter import Drafter
from specdec.engine.request import Request
from specdec.engine.sampler import sample_block
from specdec.runtime.target_runner import PrefillChunks, TargetRunner


class SpeculativeDecoding:
    def __init__(self, runner: TargetRunner, drafter: Drafter):
        self.runner = runner
        self.drafter = drafter
        self.tokens_per_step = drafter.block_size

    @torch.no_grad()
    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        bs, batch = self.tokens_per_step, len(running)
        starts = [r.num_cached for r in running]
        drafts = self.drafter.propose(running)  # [B, bs-1] on the device
        out = self.runner.run_block([r.target_pages for r in running], [r.pending_token for r in running], drafts, bs,
                                     prefill)
        accepted, bonus = accept(drafts, sample_block(out, running, bs).view(batch, bs))
        host = to_host(torch.cat([drafts, accepted[:, None].long(), bonus[:, None]], dim=1), prefill)
        tokens = []
        for row, request, start in zip(host, running, starts):
            a = row[bs - 1]
            tokens.append(row[:a] + [row[bs]])
            # keep K/V of the anchor and the accepted drafts; the bonus is the new pending token
            request.target_pages.truncate(start + a + 1)
        self.drafter.extend(running, out.features, list(range(batch)), [len(t) for t in tokens])
        return tokens

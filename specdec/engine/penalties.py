"""Penalties and logit bias (OpenAI's presence_penalty, frequency_penalty, logit_bias; vLLM's
repetition_penalty) applied to the target's logits at every verified position with the token counts as of
that position, so that speculative output equals plain decoding with the same penalties.

Row j of a request's verified block follows the committed tokens and the first j drafts: its counts are the
output's counts plus those of drafts[:j] (a row only matters when those drafts are accepted, and then they
are committed). Order, as vLLM's: logit bias, then repetition (logits of tokens seen in the prompt or output
divided by the penalty when positive, multiplied when negative), then frequency (minus penalty x count) and
presence (minus penalty once a token appeared in the output); temperature and filtering come after
(specdec/engine/sampler.py). Computed in float32, one request at a time: only requests that ask pay.
"""

from __future__ import annotations

import numpy as np
import torch

from attention.transfer import upload


def penalized(params) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


def penalized_rows(logits: torch.Tensor, request, drafts: torch.Tensor | None) -> torch.Tensor:
    """One request's verified rows [q, vocab] (any dtype) -> float32 logits with its penalties applied;
    drafts [q - 1] on the device (None for a one-row step)."""
    params, (rows, vocab) = request.params, logits.shape
    out = logits.float()
    device = out.device
    if params.logit_bias:
        ids = upload(np.fromiter(params.logit_bias.keys(), dtype=np.int64), device)
        bias = upload(np.fromiter(params.logit_bias.values(), dtype=np.float32), device)
        out.index_add_(1, ids, bias.expand(rows, -1))
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
    if request.output_ids:
        output = upload(np.asarray(request.output_ids, dtype=np.int64), device)
        counts[0].index_add_(0, output, torch.ones(len(request.output_ids), device=device))
    if drafts is not None and rows > 1:  # row j also counts drafts[:j]
        counts[1:].scatter_add_(1, drafts[:rows - 1].view(-1, 1).long(), torch.ones(rows - 1, 1, device=device))
    counts = counts.cumsum(dim=0)  # row 0 has the output's counts; row j adds drafts[:j]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        prompt = upload(np.unique(np.asarray(request.prompt_ids, dtype=np.int64)), device)
        seen[:, prompt] = True
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * (counts > 0).float()
    return out

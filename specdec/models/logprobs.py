"""Log-probabilities from logits without an fp32 copy of them: a batch's logits over a 150k vocabulary are
hundreds of MiB. The drafter's candidates (token trees) and the target's logprobs of committed tokens
(the API's `logprobs`) both come from here."""

from __future__ import annotations

import torch


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension in fp32 [..., 1], with one temporary of the logits' own size and
    dtype."""
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - top
    return top.float() + shifted.exp_().sum(dim=-1, keepdim=True, dtype=torch.float32).log()


def packed_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """Rows of logits [n, vocab] and the token chosen at each [n] -> [n, 1 + 2k] float32: the chosen token's
    log-probability, then the k most likely tokens' log-probabilities and their ids (exact in float32 up to
    2^24), so that one transfer brings everything to the host."""
    normalizer = log_normalizer(logits)
    chosen = logits.gather(-1, tokens.view(-1, 1).long()).float() - normalizer
    if k == 0:
        return chosen
    top, ids = logits.topk(k, dim=-1)
    return torch.cat([chosen, top.float() - normalizer, ids.float()], dim=-1)

"""Penalties and logit bias (OpenAI's presence_penalty, frequency_penalty, logit_bias; vLLM's
repetition_penalty) applied to the target's logits at every verified position with the token counts as of
that position, so that speculative output equals plain decoding with the same penalties.

Row j of a request's verified block follows the committed tokens and the first j drafts: its counts are the
output's counts plus those of drafts[:j] (a row only matters when those drafts are accepted, and then they
are committed). Order, as vLLM's: logit bias, then repetition (logits of tokens seen in the prompt or output
divided by the penalty when positive, multiplied when negative), then frequency (minus penalty x count) and
presence (minus penalty once a token appeared in the output); temperature and filtering come after
(specdec/engine/sampler.py). A request with min_tokens cannot end before its output has that many tokens: at rows
that would give an earlier token its ending ids (`Request.ending_ids`) are masked. Computed in float32 for the
requests that ask, all of them at once.
"""

from __future__ import annotations

import numpy as np
import torch

from attention.transfer import upload

CHUNK_BYTES = 128 << 20  # float32 rows handled at once (150k-token vocabularies: 13 requests of 16 rows)


def penalized_rows(logits: torch.Tensor, requests: list, drafts: torch.Tensor | None) -> torch.Tensor:
    """The verified rows of P requests [P * q, vocab] (any dtype) -> float32 logits with each request's
    penalties applied; drafts [P, q - 1] on the device (None for one-row steps). All requests at once: a few
    kernels per step, whatever P (one host upload of every request's tokens)."""
    batch = len(requests)
    rows, vocab = logits.shape[0] // batch, logits.shape[1]
    chunk = max(1, CHUNK_BYTES // (rows * vocab * 4))  # requests at once: a few float32 copies of their rows each
    if batch > chunk:
        return torch.cat([penalized_rows(logits[i * rows:(i + chunk) * rows], requests[i:i + chunk],
                                         drafts[i:i + chunk] if drafts is not None else None)
                          for i in range(0, batch, chunk)])
    device = logits.device
    out = logits.to(torch.float32, copy=True).view(batch, rows, vocab)  # the caller's logits stay as they are
    params = [r.params for r in requests]
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if biased:
        req, tok, bias = (upload(np.asarray(column, dtype=dtype), device)
                          for column, dtype in zip(zip(*biased), (np.int64, np.int64, np.float32)))
        out += _scatter(batch, vocab, req, tok, bias, device)[:, None, :]
    counts = torch.zeros(batch, rows, vocab, dtype=torch.float32, device=device)
    req, tok = _token_pairs([r.output_ids for r in requests], device)
    if req is not None:  # row 0: the committed output's counts
        counts[:, 0].index_put_((req, tok), torch.ones_like(tok, dtype=torch.float32), accumulate=True)
    if drafts is not None and rows > 1:  # row j also counts drafts[:j]
        counts[:, 1:].scatter_add_(2, drafts[:, :rows - 1, None].long(), torch.ones(batch, rows - 1, 1, device=device))
    counts = counts.cumsum(dim=1)
    if any(p.repetition_penalty != 1.0 for p in params):
        repetition = _per_request([p.repetition_penalty for p in params], device)
        seen = counts > 0
        req, tok = _token_pairs([r.prompt_ids for r in requests], device)
        seen |= _scatter(batch, vocab, req, tok, torch.ones_like(tok, dtype=torch.float32), device)[:, None, :] > 0
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if any(p.frequency_penalty for p in params):
        out = out - _per_request([p.frequency_penalty for p in params], device) * counts
    if any(p.presence_penalty for p in params):
        out = out - _per_request([p.presence_penalty for p in params], device) * (counts > 0).float()
    _hold_ending(out, requests)
    return out.view(batch * rows, vocab)


def _hold_ending(out: torch.Tensor, requests: list) -> None:
    """Ending ids masked (-inf) in the rows [batch, rows, vocab] whose token would come before a request's
    min_tokens-th output token (row j gives output token len(output) + j), in place."""
    rows = out.shape[1]
    held = [(i, j, token) for i, r in enumerate(requests)
            for j in range(min(rows, r.params.min_tokens - len(r.output_ids))) for token in r.ending_ids]
    if held:
        index = upload(np.asarray(held, dtype=np.int64).T.reshape(-1), out.device).view(3, -1)
        out[index[0], index[1], index[2]] = float("-inf")


def _per_request(values: list[float], device) -> torch.Tensor:
    return upload(np.asarray(values, dtype=np.float32), device)[:, None, None]


def _token_pairs(token_lists: list[list[int]], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(request index, token) of every token of every list, on the device (one upload)."""
    lengths = [len(tokens) for tokens in token_lists]
    if not sum(lengths):
        return None, None
    pairs = np.empty((2, sum(lengths)), dtype=np.int64)
    pairs[0] = np.repeat(np.arange(len(token_lists)), lengths)
    pairs[1] = np.concatenate([np.asarray(tokens, dtype=np.int64) for tokens in token_lists if tokens])
    both = upload(pairs.reshape(-1), device)
    return both[:pairs.shape[1]], both[pairs.shape[1]:]


def _scatter(batch: int, vocab: int, req, tok, values, device) -> torch.Tensor:
    """A [batch, vocab] float32 matrix with values added at (req, tok)."""
    dense = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    if req is not None:
        dense.index_put_((req, tok), values, accumulate=True)
    return dense

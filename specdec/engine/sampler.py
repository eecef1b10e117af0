"""Turning target logits into tokens: greedy, or temperature / top-k / top-p / min-p sampling.

The same functions serve autoregressive decoding and speculative verification, so both draw
from exactly the same distribution. A whole batch is sampled in one set of tensor operations
(inverse CDF): each sampling request owns a host random stream (`random.Random`, seeded when the
request has a seed) that gives one uniform number per row, so the same seed gives the same tokens
whatever else is in the batch, and no step launches kernels per request.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from attention.transfer import HostCopy, upload
from specdec.engine.grammar import bitmask, masked
from specdec.engine.penalties import penalized_rows
from specdec.engine.sampling_params import SamplingParams


def _row_values(values: list, rows_per_request: list[int], device, dtype: np.dtype) -> torch.Tensor:
    """Each request's value repeated over its rows, on the device (an asynchronous copy: no host wait)."""
    return upload(np.repeat(np.asarray(values, dtype=dtype), rows_per_request), device)


def _filtered_batch_probs(logits: torch.Tensor, rows_per_request: list[int],
                          params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probs [n, vocab], order): each row's filtered distribution over the vocabulary in `order`
    (None: the vocabulary's own order). Rows of greedy requests get temperature 1 (their samples
    are not used). Sorting happens only when some request filters by rank (top-k or top-p)."""
    vocab = logits.shape[-1]
    temperature = _row_values([p.temperature if not p.greedy else 1.0 for p in params], rows_per_request,
                              logits.device, np.float32)
    scaled = logits.float() / temperature[:, None]
    if all(p.greedy or (p.top_p >= 1.0 and not 0 < p.top_k < vocab) for p in params):
        return _min_p_filtered(scaled.softmax(dim=-1), None, rows_per_request, params), None
    top_k = _row_values([p.top_k if 0 < p.top_k < vocab else vocab for p in params], rows_per_request,
                        logits.device, np.int64)
    # top_p 1 keeps everything: infinity, so that rounding in the cumulative sum drops no tail token
    top_p = _row_values([p.top_p if p.top_p < 1.0 else float("inf") for p in params], rows_per_request,
                        logits.device, np.float32)
    ordered, order = scaled.sort(dim=-1, descending=True)
    kth = ordered.gather(-1, (top_k - 1)[:, None])  # ties with the k-th logit stay
    probs = ordered.masked_fill(ordered < kth, float("-inf")).softmax(dim=-1)
    drop = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # the top token always stays
    return _min_p_filtered(probs.masked_fill(drop, 0.0), probs[:, :1], rows_per_request, params), order


def _min_p_filtered(probs: torch.Tensor, likeliest: torch.Tensor | None, rows_per_request: list[int],
                    params: list[SamplingParams]) -> torch.Tensor:
    """`probs` less every token below min_p times its row's likeliest (`likeliest` [n, 1], None: the row's
    max), after top-k and top-p (the HF order). Those keep the likeliest token and leave the ratios of the
    tokens they keep as they were, so the threshold is the same whether measured before or after them."""
    if not any(p.min_p and not p.greedy for p in params):
        return probs
    min_p = _row_values([p.min_p if not p.greedy else 0.0 for p in params], rows_per_request, probs.device,
                        np.float32)
    if likeliest is None:
        likeliest = probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < min_p[:, None] * likeliest, 0.0)


def sample_batch(logits: torch.Tensor, rows_per_request: list[int], params: list[SamplingParams],
                 generators: list[random.Random | None]) -> torch.Tensor:
    """Logits of a whole batch, request by request ([sum(rows), vocab]) -> tokens [sum(rows)]: the argmax
    for greedy requests, for the others a draw from the logits after temperature, top-k, top-p, then min-p
    (the HF order; one uniform of the request's stream per row, mapped through the row's cumulative
    distribution)."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    probs, order = _filtered_batch_probs(logits, rows_per_request, params)
    uniforms = [g.random() if not p.greedy else 0.0
                for p, g, rows in zip(params, generators, rows_per_request) for _ in range(rows)]
    cdf = probs.cumsum(dim=-1)
    targets = upload(np.asarray(uniforms, dtype=np.float32), cdf.device)[:, None] * cdf[:, -1:]
    # right=True skips zero-probability entries (flat stretches of the CDF); the clamp guards rounding
    index = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[-1] - 1)
    sampled = (index if order is None else order.gather(-1, index)).squeeze(-1)
    is_greedy = _row_values([p.greedy for p in params], rows_per_request, logits.device, np.bool_)
    return torch.where(is_greedy, greedy, sampled)


def make_generator(seed: int | None) -> random.Random:
    """A request's random stream: from its seed, else from the OS."""
    return random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))


def sample_block(out, requests: list, rows_per_request: int, drafts: torch.Tensor | None = None,
                 drafts_host: HostCopy | None = None) -> torch.Tensor:
    """Tokens for every row of a block step (`out` has the rows' `logits` and their argmax `greedy`):
    the in-step argmax when every request is greedy, else sampled (`sample_rows`)."""
    return sample_rows(out.logits, out.greedy, requests, rows_per_request, drafts, drafts_host)


def sample_rows(logits: torch.Tensor, greedy: torch.Tensor | None, requests: list, rows_per_request: int,
                drafts: torch.Tensor | None = None, drafts_host: HostCopy | None = None) -> torch.Tensor:
    """Tokens for `rows_per_request` rows of logits per request ([B * rows, vocab]; `greedy`: their argmax if
    known). Requests with penalties, a logit bias or structured output are sampled from their rows with those
    applied: penalties (specdec/engine/penalties.py), then the grammar's mask (specdec/engine/grammar.py).
    `drafts` [B, rows - 1]: what each row follows (`drafts_host`: their copy on its way to the host, started
    before the forward). Each request's random stream is drawn from once per row either way."""
    adjusted = [i for i, r in enumerate(requests) if r.params.adjusts_logits]
    if not adjusted:
        if all(r.params.greedy for r in requests):
            return greedy if greedy is not None else logits.argmax(dim=-1)
        return sample_batch(logits, [rows_per_request] * len(requests), [r.params for r in requests],
                            [r.generator for r in requests])
    tokens = (greedy if greedy is not None else logits.argmax(dim=-1))[:len(requests) * rows_per_request].clone()
    others = [i for i, r in enumerate(requests) if not r.params.greedy and not r.params.adjusts_logits]
    for chosen, adjust in ((others, False), (adjusted, True)):
        if not chosen:
            continue
        index = upload((np.asarray(chosen)[:, None] * rows_per_request + np.arange(rows_per_request)).reshape(-1),
                       logits.device)
        picked = [requests[i] for i in chosen]
        source = logits[index]
        if adjust:
            source = _adjusted(source, picked, chosen, rows_per_request, drafts, drafts_host)
        tokens[index] = sample_batch(source, [rows_per_request] * len(chosen), [r.params for r in picked],
                                     [r.generator for r in picked])
    return tokens


def _adjusted(rows: torch.Tensor, requests: list, chosen: list[int], rows_per_request: int,
              drafts: torch.Tensor | None, drafts_host: HostCopy | None) -> torch.Tensor:
    """The rows of `requests` (requests[j] is the step's request chosen[j]) with their penalties and grammar
    masks applied."""
    if any(r.params.penalized for r in requests):
        rows = penalized_rows(rows, requests, drafts[upload(np.asarray(chosen), rows.device)]
                              if drafts is not None else None)
    if any(r.matcher is not None for r in requests):
        walked = None
        if drafts is not None and rows_per_request > 1:
            every = drafts_host.tolist() if drafts_host is not None else drafts.tolist()
            walked = [every[i] for i in chosen]
        bits = bitmask(requests, rows_per_request, walked, rows.shape[1])
        rows = masked(rows, upload(bits, rows.device))
    return rows

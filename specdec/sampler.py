"""Turning target logits into tokens: greedy, or temperature / top-k / top-p sampling.

The same functions serve autoregressive decoding and speculative verification, so both draw
from exactly the same distribution. Seeded requests own a torch.Generator: same seed, same tokens.
"""

from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, vocab] -> probabilities after temperature, top-k, then top-p (the HF order)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_rows(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [n, vocab] for one request -> [n] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_batch(logits: torch.Tensor, rows_per_request: list[int], params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
    """Logits of a whole batch, request by request ([sum(rows), vocab]) -> tokens [sum(rows)]."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1)
    chunks = logits.split(rows_per_request)
    return torch.cat([sample_rows(c, p, g) for c, p, g in zip(chunks, params, generators)])


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator

"""The batched sampler: each row draws from `filtered_probs` of its request, from the request's own
random stream, whatever else is in the batch."""

import random

import pytest
import torch
from scipy.stats import chisquare

from specdec.engine.sampler import make_generator, sample_batch
from specdec.engine.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The oracle: logits [n, vocab] -> probabilities after temperature, top-k, top-p, then min-p (the HF order)
    for one request's params, written plainly, one request at a time."""
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
    if params.min_p:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


VOCAB, DRAWS = 12, 20000
FILTERS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.8),
           dict(temperature=1.0, top_k=6, top_p=0.9), dict(temperature=1.0, min_p=0.1),
           dict(temperature=0.8, top_k=8, top_p=0.95, min_p=0.1)]


def logits_row(seed=0):
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


def draws(row, params, others=()):
    """DRAWS samples of `row` under `params`, one request each, mixed with `others` (params, row) requests."""
    rows = [row] * DRAWS + [r for _, r in others]
    every = [params] * DRAWS + [p for p, _ in others]
    tokens = sample_batch(torch.cat(rows), [1] * len(rows), every, [make_generator(i) for i in range(len(rows))])
    return tokens[:DRAWS]


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_rows_follow_filtered_probs(filters):
    row, params = logits_row(), SamplingParams(max_new_tokens=1, **filters)
    others = [(SamplingParams(max_new_tokens=1, top_k=2, temperature=0.5), logits_row(1)),
              (SamplingParams(max_new_tokens=1), logits_row(2))]  # a filtering request and a greedy one
    want = filtered_probs(row, params)[0].double()
    counts = torch.bincount(draws(row, params, others), minlength=VOCAB).double()
    assert (counts[want == 0] == 0).all()  # filtered-out tokens never come
    kept = want > 0
    assert chisquare(counts[kept], want[kept] / want[kept].sum() * DRAWS).pvalue > 1e-3
    # and the same check rejects a neighbouring distribution
    hotter = filtered_probs(row, SamplingParams(max_new_tokens=1, **{**filters, "temperature": 2 * filters["temperature"]}))[0].double()
    if (hotter[kept] > 0).all() and (hotter[~kept] == 0).all():
        assert chisquare(counts[kept], hotter[kept] / hotter[kept].sum() * DRAWS).pvalue < 1e-6


def test_a_seed_gives_the_same_tokens_whatever_the_batch():
    rows = torch.cat([logits_row(s) for s in range(4)])
    mine = SamplingParams(max_new_tokens=1, temperature=0.9, top_p=0.95, seed=7)
    alone = [sample_batch(rows[:1].repeat(3, 1), [3], [mine], [make_generator(7)]).tolist() for _ in range(2)]
    mixed = sample_batch(torch.cat([rows[1:3], rows[:1].repeat(3, 1), rows[3:]]), [1, 1, 3, 1],
                         [SamplingParams(max_new_tokens=1, temperature=1.0, seed=1), SamplingParams(max_new_tokens=1),
                          mine, SamplingParams(max_new_tokens=1, top_k=2, temperature=1.0, seed=3)],
                         [make_generator(1), None, make_generator(7), make_generator(3)])
    assert alone[0] == alone[1] == mixed[2:5].tolist()
    assert mixed[1].item() == rows[2].argmax().item()  # the greedy request takes the argmax
    other = [sample_batch(rows[:1].repeat(3, 1), [3], [mine], [make_generator(s)]).tolist() for s in range(8, 14)]
    assert any(o != alone[0] for o in other)  # other seeds, other tokens


def test_all_greedy_is_the_argmax():
    rows = torch.randn(5, VOCAB)
    out = sample_batch(rows, [2, 3], [SamplingParams(max_new_tokens=1)] * 2, [None, None])
    assert out.tolist() == rows.argmax(-1).tolist()


def test_unseeded_streams_differ():
    assert make_generator(None).random() != make_generator(None).random()
    assert make_generator(5).random() == random.Random(5).random()

"""Sampled outcomes of many requests of one prompt over a tiny model of a small vocabulary, and the chi-square test
that compares two such distributions (the lossless-sampling tests)."""

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import build_tiny_model

SMALL_VOCAB, SAMPLES, NEW_TOKENS = 10, 3000, 3
PROMPT = [4, 7, 1]


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("small-vocab")
    build_tiny_model("qwen3", path, seed=11, vocab_size=SMALL_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return path


def outcomes(engine, params_for):
    requests = [engine.make_request(PROMPT, params_for(i)) for i in range(SAMPLES)]
    engine.run(requests)
    return Counter(tuple(r.output_ids) for r in requests)


def p_value(a: Counter, b: Counter) -> float:
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    rows, rare = [], [0, 0]
    for k in keys:  # pool outcomes too rare for the chi-square approximation
        if a[k] + b[k] >= 10:
            rows.append([a[k], b[k]])
        else:
            rare[0] += a[k]
            rare[1] += b[k]
    if sum(rare):
        rows.append(rare)
    return chi2_contingency(list(zip(*rows)))[1]


def sampling(temperature, seed_base, **kw):
    return lambda i: SamplingParams(max_new_tokens=NEW_TOKENS, temperature=temperature, seed=seed_base + i,
                                    ignore_eos=True, **kw)

"""Speculative sampling is lossless: the distribution of generated sequences equals autoregressive
sampling (chi-square over all outcomes), and seeded speculative runs are reproducible."""

import pytest

from specdec.engine.sampling_params import SamplingParams
from tests.drafter_helpers import ScriptedDrafter
from tests.engine_helpers import spec_engine, tiny_engine
from tests.sampling_helpers import (PROMPT, SAMPLES, SMALL_VOCAB, outcomes, p_value, sampling,  # noqa: F401
                                    small_vocab_target)


@pytest.mark.parametrize("filters", [{}, {"top_k": 5, "top_p": 0.9}, {"min_p": 0.2}])
def test_speculative_sampling_matches_autoregressive(small_vocab_target, filters):
    greedy = tiny_engine(small_vocab_target, eos=()).generate_ids([PROMPT], SamplingParams(max_new_tokens=8))[0]
    drafter = ScriptedDrafter({tuple(PROMPT): greedy.output_ids}, 3, SMALL_VOCAB)
    spec = outcomes(spec_engine(small_vocab_target, drafter, max_num_seqs=SAMPLES), sampling(1.0, 0, **filters))
    auto = outcomes(tiny_engine(small_vocab_target, eos=(), max_num_seqs=SAMPLES),
                    sampling(1.0, 10 ** 6, **filters))
    assert p_value(spec, auto) > 1e-3
    # the same test does reject a different distribution (a cooler temperature)
    cooler = outcomes(tiny_engine(small_vocab_target, eos=(), max_num_seqs=SAMPLES),
                      sampling(0.7, 2 * 10 ** 6, **filters))
    assert p_value(cooler, auto) < 1e-3


def test_seeded_speculative_sampling_is_reproducible(small_vocab_target):
    greedy = tiny_engine(small_vocab_target, eos=()).generate_ids([PROMPT], SamplingParams(max_new_tokens=8))[0]

    def run():
        drafter = ScriptedDrafter({tuple(PROMPT): greedy.output_ids}, 4, SMALL_VOCAB)
        engine = spec_engine(small_vocab_target, drafter)
        requests = [engine.make_request(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.9, seed=s,
                                                               ignore_eos=True)) for s in range(20)]
        engine.run(requests)
        return [r.output_ids for r in requests]

    first = run()
    assert first == run()
    assert len(set(map(tuple, first))) > 1


def test_tree_speculative_sampling_matches_autoregressive(small_vocab_target, tmp_path):
    """Token trees keep sampling lossless: a node stays only when its token is the target's own draw at
    its parent (four candidates per position cover much of this vocabulary, so most steps accept some)."""
    from tests.engine_helpers import dflash_drafter

    drafter = dflash_drafter(small_vocab_target, tmp_path, 3)
    engine = spec_engine(small_vocab_target, drafter, max_num_seqs=SAMPLES, verify="tree", attention_backend="torch")
    tree = outcomes(engine, sampling(1.0, 3 * 10 ** 6))
    auto = outcomes(tiny_engine(small_vocab_target, eos=(), max_num_seqs=SAMPLES), sampling(1.0, 4 * 10 ** 6))
    assert p_value(tree, auto) > 1e-3
    assert engine.pool.num_free == engine.pool.num_pages

"""n answers per prompt: answer j is the single answer seeded with seed + j, the answers after the first share
the first's prompt pages instead of prefilling them (prefix cache), with speculation and without."""

import pytest

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, spec_engine, tiny_engine

LONG = [(5 * i + 7) % 90 + 3 for i in range(23)]  # 5 full pages of 4 and a part


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("samples")
    build_tiny_model("qwen3", path, seed=6)
    return path


@pytest.mark.parametrize("drafter", [False, True])
def test_answer_j_is_the_single_answer_seeded_with_seed_plus_j(target_dir, tmp_path, drafter):
    make = (lambda: spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4))) if drafter else \
        (lambda: tiny_engine(target_dir, eos=()))
    params = SamplingParams(max_new_tokens=9, temperature=0.9, seed=100, n=3)
    engine = make()
    answers = engine.generate_ids([LONG, MANY_PROMPTS[0]], params)
    assert len(answers) == 6
    for i, prompt in enumerate([LONG, MANY_PROMPTS[0]]):
        for j in range(3):
            [single] = make().generate_ids([prompt], SamplingParams(max_new_tokens=9, temperature=0.9, seed=100 + j))
            assert answers[3 * i + j].output_ids == single.output_ids
            assert answers[3 * i + j].prompt_ids == prompt
    assert len({tuple(a.output_ids) for a in answers[:3]}) > 1  # different seeds, different answers
    assert [a.stats.cached_tokens for a in answers[:3]] == [0, 20, 20]  # the prompt's full pages, shared
    assert_no_leak(engine)


def test_greedy_answers_are_equal_and_the_cache_off_runs_them_together(target_dir):
    params = SamplingParams(max_new_tokens=7, n=4)
    off = tiny_engine(target_dir, eos=(), enable_prefix_caching=False).generate_ids([LONG], params)
    on = tiny_engine(target_dir, eos=()).generate_ids([LONG], params)
    assert len({tuple(a.output_ids) for a in on + off}) == 1
    assert [a.stats.cached_tokens for a in off] == [None] * 4


def test_n_is_checked_and_add_request_takes_one_answer(target_dir):
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="add_samples queues n"):
        tiny_engine(target_dir).add_request(LONG, SamplingParams(n=2))
    engine = tiny_engine(target_dir, eos=())
    samples = engine.add_samples(LONG, SamplingParams(max_new_tokens=3, n=2))
    while engine.has_unfinished_requests:
        engine.step()
    assert all(s.finish_reason == "length" for s in samples) and samples[1].lead is None

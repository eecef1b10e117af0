"""stop_token_ids and min_tokens (vLLM's): a stop token id ends the answer as end of sequence does (also with
ignore_eos, the token kept as the answer's last), and min_tokens masks every ending id at the rows that would give
an earlier output token, so that speculative greedy output equals plain greedy output with them, and plain
decoding equals a direct loop."""

import pytest

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, spec_engine, tiny_engine

NEW = 16
SPECULATION = [dict(), dict(verify="tree", tree_nodes=7), dict(verify="auto", max_num_seqs=3)]
SPECULATION_IDS = ["chain", "tree", "auto-with-arrivals"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("stop-tokens")
    build_tiny_model("qwen3", path, seed=8)
    return path


@pytest.fixture(scope="module")
def free_answers(target_dir) -> list[list[int]]:
    """Greedy answers of NEW tokens with nothing ending them."""
    engine = tiny_engine(target_dir, eos=())
    return [r.output_ids for r in engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=NEW))]


def stop_token_of(answer: list[int]) -> int:
    """A token of the answer's middle that first occurs there or before."""
    return answer[NEW // 2]


def test_a_stop_token_id_ends_the_answer_at_its_first_occurrence(target_dir, free_answers):
    answer = free_answers[0]
    stop = stop_token_of(answer)
    for ignore_eos in (False, True):
        engine = tiny_engine(target_dir, eos=(answer[-1],) if answer[-1] != stop else ())
        [request] = engine.generate_ids([MANY_PROMPTS[0]], SamplingParams(
            max_new_tokens=NEW, stop_token_ids=[stop], ignore_eos=ignore_eos))
        assert request.output_ids == answer[:answer.index(stop) + 1] and request.finish_reason == "stop"
        assert_no_leak(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_min_tokens_equals_a_direct_loop_masking_the_ending_ids(target_dir, free_answers, overlap):
    """End of sequence is the answer's 3rd token: with min_tokens the answer goes on past it and ends at the first
    ending id (end of sequence or a stop token id) from the min_tokens-th token on."""
    prompt, answer = MANY_PROMPTS[0], free_answers[0]
    eos, stop = answer[2], stop_token_of(answer)
    engine = tiny_engine(target_dir, eos=(eos,), overlap_steps=overlap)
    [early] = engine.generate_ids([prompt], SamplingParams(max_new_tokens=NEW))
    assert early.output_ids == answer[:answer.index(eos) + 1]
    params = SamplingParams(max_new_tokens=NEW, min_tokens=6, stop_token_ids=[stop])
    [request] = engine.generate_ids([prompt], params)
    output = []
    while len(output) < NEW and (len(output) < 6 or output[-1] not in (eos, stop)):
        logits = engine.next_token_logits(prompt + output)
        if len(output) < 6:
            logits[[eos, stop]] = float("-inf")
        output.append(int(logits.argmax()))
    assert request.output_ids == output and len(output) > 6
    assert eos not in output[:6] and stop not in output[:6]
    assert_no_leak(engine)


@pytest.mark.parametrize("config", SPECULATION, ids=SPECULATION_IDS)
def test_speculative_greedy_equals_plain_greedy_with_stop_tokens_and_min_tokens(target_dir, tmp_path, free_answers,
                                                                             config):
    """Mixed batches: requests with a stop token id, with min_tokens past their end of sequence, with both, and with
    neither."""
    prompts = MANY_PROMPTS[:8]
    eos = free_answers[0][2]
    params = [SamplingParams(max_new_tokens=NEW, stop_token_ids=[stop_token_of(free_answers[1])]),
              SamplingParams(max_new_tokens=NEW, min_tokens=7),
              SamplingParams(max_new_tokens=NEW, min_tokens=5, stop_token_ids=[stop_token_of(free_answers[2])]),
              SamplingParams(max_new_tokens=NEW)]
    plain = tiny_engine(target_dir, eos=(eos,))
    expected = [plain.generate_ids([p], params[i % 4])[0].output_ids for i, p in enumerate(prompts)]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), eos=(eos,), **config)
    requests = [engine.make_request(p, params[i % 4]) for i, p in enumerate(prompts)]
    engine.run(requests)
    assert [r.output_ids for r in requests] == expected
    assert any(len(e) < NEW for e in expected) and any(len(e) > 7 for e in expected)
    assert_no_leak(engine)


@pytest.mark.parametrize("bad, message", [
    (dict(stop_token_ids=[-3]), "stop_token_ids must be a list"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids must be a list"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids must be a list"),
    (dict(min_tokens=-1), "min_tokens must be an integer"),
    (dict(min_tokens=9, max_new_tokens=8), "min_tokens must be an integer"),
])
def test_bad_stop_tokens_and_min_tokens_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_stop_token_outside_the_vocabulary_fails_the_request_alone(target_dir):
    engine = tiny_engine(target_dir, eos=())
    request = engine.add_request(MANY_PROMPTS[0], SamplingParams(stop_token_ids=[10**6]))
    assert request.finish_reason == "error" and "stop_token_ids names token ids" in request.error

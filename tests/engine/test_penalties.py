"""Penalties and logit bias are exact under speculation: each verified row is penalized with the counts as
of its position along the draft, so speculative greedy output equals plain greedy output with the same
penalties, and plain decoding equals a direct loop applying them to the target's logits."""

import pytest
import torch

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB, build_tiny_model
from tests.drafter_helpers import ScriptedDrafter
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, spec_engine, tiny_engine

PENALTIES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=1.8),
             dict(logit_bias={7: 3.0, 11: -5.0}),
             dict(frequency_penalty=0.7, presence_penalty=0.5, repetition_penalty=1.3, logit_bias={20: 1.0})]
IDS = ["frequency", "presence", "repetition", "logit_bias", "all"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("penalties")
    build_tiny_model("qwen3", path, seed=8)
    return path


def penalized_by_hand(logits: torch.Tensor, prompt: list[int], output: list[int], p: dict) -> torch.Tensor:
    """The same penalties, written out over a plain list of previous tokens."""
    logits = logits.clone()
    for token, bias in (p.get("logit_bias") or {}).items():
        logits[token] += bias
    r = p.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= p.get("frequency_penalty", 0.0) * output.count(token) + p.get("presence_penalty", 0.0)
    return logits


@pytest.mark.parametrize("penalties", PENALTIES, ids=IDS)
@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_equals_a_direct_loop(target_dir, penalties, overlap):
    engine = tiny_engine(target_dir, eos=(), overlap_steps=overlap)
    prompt = MANY_PROMPTS[0]
    [request] = engine.generate_ids([prompt], SamplingParams(max_new_tokens=12, **penalties))
    output = []
    for _ in range(12):
        logits = engine.next_token_logits(prompt + output)
        output.append(int(penalized_by_hand(logits, prompt, output, penalties).argmax()))
    assert request.output_ids == output
    plain = tiny_engine(target_dir, eos=()).generate_ids([prompt], SamplingParams(max_new_tokens=12))[0]
    assert plain.output_ids != output or penalties.get("logit_bias")  # the penalties changed something
    assert_no_leak(engine)


@pytest.mark.parametrize("config", [dict(), dict(verify="tree", tree_nodes=7), dict(verify="auto", max_num_seqs=3)],
                         ids=["chain", "tree", "auto-with-arrivals"])
@pytest.mark.parametrize("penalties", PENALTIES, ids=IDS)
def test_speculative_greedy_equals_plain_greedy_with_penalties(target_dir, tmp_path, config, penalties):
    params = [SamplingParams(max_new_tokens=14, **penalties), SamplingParams(max_new_tokens=14)]
    prompts = MANY_PROMPTS[:6]
    plain = tiny_engine(target_dir, eos=())
    expected = [plain.generate_ids([p], params[i % 2])[0].output_ids for i, p in enumerate(prompts)]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), **config)
    requests = [engine.make_request(p, params[i % 2]) for i, p in enumerate(prompts)]  # mixed batches
    engine.run(requests)
    assert [r.output_ids for r in requests] == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("penalties", PENALTIES, ids=IDS)
@pytest.mark.parametrize("error_rate", [0.0, 0.3], ids=["all-accepted", "noisy"])
def test_drafts_that_follow_the_penalized_answer_are_accepted_and_exact(target_dir, penalties, error_rate):
    """A drafter proposing the penalized answer itself: every verified row past the first follows accepted
    drafts, so each row must count them (a row counting only the committed output would reject them)."""
    params = SamplingParams(max_new_tokens=14, **penalties)
    plain = tiny_engine(target_dir, eos=())
    expected = [plain.generate_ids([p], params)[0].output_ids for p in MANY_PROMPTS[:4]]
    drafter = ScriptedDrafter({tuple(p): e for p, e in zip(MANY_PROMPTS, expected)}, 4, VOCAB, error_rate=error_rate)
    engine = spec_engine(target_dir, drafter)
    got = engine.generate_ids(MANY_PROMPTS[:4], params)
    assert [r.output_ids for r in got] == expected
    if error_rate == 0:
        assert all(max(r.stats.acceptance_lengths) == 4 for r in got)
    assert_no_leak(engine)


def test_a_large_bias_forces_a_token(target_dir):
    [request] = tiny_engine(target_dir, eos=()).generate_ids([MANY_PROMPTS[1]], SamplingParams(
        max_new_tokens=5, logit_bias={42: 100.0}, temperature=0.7, seed=1))
    assert request.output_ids == [42] * 5


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty must be a number in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number in"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must map"),
    (dict(logit_bias={5: 101}), "logit_bias must map"),
])
def test_bad_penalties_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_a_bias_outside_the_vocabulary_fails_the_request_alone(target_dir):
    engine = tiny_engine(target_dir, eos=())
    request = engine.add_request(MANY_PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
    assert request.finish_reason == "error" and "outside the vocabulary" in request.error


def test_requests_penalized_together_or_in_chunks_get_the_same_rows(monkeypatch):
    """The batched penalties equal one request at a time, chunks of requests, and leave the logits given alone."""
    from types import SimpleNamespace

    import specdec.engine.penalties as penalties

    torch.manual_seed(0)
    vocab, rows, count = 50, 4, 5
    requests = [SimpleNamespace(params=SamplingParams(frequency_penalty=0.3 * i, presence_penalty=0.1,
                                                      repetition_penalty=1.0 + 0.1 * i,
                                                      logit_bias={3: float(i)} if i % 2 else None),
                                output_ids=[1, 2, 2, 5 + i][:i], prompt_ids=[7, 8, i]) for i in range(count)]
    logits, drafts = torch.randn(count * rows, vocab), torch.randint(0, vocab, (count, rows - 1))
    given = logits.clone()
    together = penalties.penalized_rows(logits, requests, drafts)
    assert torch.equal(logits, given)
    alone = torch.cat([penalties.penalized_rows(logits[i * rows:(i + 1) * rows], [r], drafts[i:i + 1])
                       for i, r in enumerate(requests)])
    monkeypatch.setattr(penalties, "CHUNK_BYTES", rows * vocab * 4 * 2)
    chunked = penalties.penalized_rows(logits, requests, drafts)
    assert torch.allclose(together, alone) and torch.allclose(together, chunked)

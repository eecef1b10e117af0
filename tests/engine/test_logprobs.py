"""Logprobs are the target's: equal with and without the drafter (chains, trees, overlapped steps, arrivals
mid-run), equal to a direct forward of the target over prompt + output, and only for requests that ask."""

import pytest
import torch

from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import (MANY_PROMPTS, assert_logprobs_close, assert_no_leak, dflash_drafter, module_target,
                                  spec_engine, tiny_engine)

ASK = SamplingParams(max_new_tokens=11, logprobs=4)


target_dir = module_target("logprobs", seed=4)


def direct_logprobs(engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every output position, from one forward of prompt + output."""
    ids = prompt + output
    rows = []
    for n in range(len(prompt), len(ids)):  # the logits that chose ids[n]
        rows.append(torch.log_softmax(engine.next_token_logits(ids[:n]), dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("overlap", [True, False])
def test_plain_decoding_logprobs_equal_a_direct_forward(target_dir, overlap):
    engine = tiny_engine(target_dir, eos=(), overlap_steps=overlap)
    requests = engine.generate_ids(MANY_PROMPTS[:5], ASK)
    for request in requests:
        assert len(request.output_logprobs) == len(request.output_ids) == 11
        direct = direct_logprobs(engine, request.prompt_ids, request.output_ids)
        for position, (entry, row) in enumerate(zip(request.output_logprobs, direct)):
            assert entry.token == request.output_ids[position]
            assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
            top = row.topk(4)
            assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry.top[0][1] >= entry.logprob - 1e-6  # greedy: the chosen token is the most likely
    assert_no_leak(engine)


SPEC_CONFIGS = [dict(), dict(verify="tree", tree_nodes=7), dict(verify="auto", max_num_seqs=2)]
SPEC_IDS = ["chain", "tree", "auto-with-arrivals"]


@pytest.mark.parametrize("config", SPEC_CONFIGS, ids=SPEC_IDS)
def test_speculative_logprobs_equal_plain_decoding(target_dir, tmp_path, config):
    plain = tiny_engine(target_dir, eos=()).generate_ids(MANY_PROMPTS, ASK)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), **config)
    spec = engine.generate_ids(MANY_PROMPTS, ASK)
    for a, b in zip(spec, plain):
        assert a.output_ids == b.output_ids
        assert_logprobs_close(a.output_logprobs, b.output_logprobs)
    assert_no_leak(engine)


@pytest.mark.parametrize("config", SPEC_CONFIGS, ids=SPEC_IDS)
def test_sampled_speculative_logprobs_are_the_targets_at_each_committed_token(target_dir, tmp_path, config):
    """Sampled speculation draws other tokens than plain sampling with the same seed (equal in distribution
    only), so its logprobs are checked against a direct forward over its own output."""
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), **config)
    params = SamplingParams(max_new_tokens=11, logprobs=2, temperature=0.8, seed=5)
    for request in engine.generate_ids(MANY_PROMPTS[:4], params):
        direct = direct_logprobs(engine, request.prompt_ids, request.output_ids)
        assert [t.token for t in request.output_logprobs] == request.output_ids
        assert [t.logprob for t in request.output_logprobs] == pytest.approx(
            direct.gather(1, torch.tensor(request.output_ids)[:, None]).squeeze(1).tolist(), abs=1e-4)


def test_only_requests_that_ask_get_logprobs(target_dir, tmp_path):
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4))
    asking = engine.make_request(MANY_PROMPTS[0], ASK)
    silent = engine.make_request(MANY_PROMPTS[1], SamplingParams(max_new_tokens=11))
    zero = engine.make_request(MANY_PROMPTS[2], SamplingParams(max_new_tokens=11, logprobs=0))
    engine.run([asking, silent, zero])
    assert silent.output_logprobs is None
    assert len(asking.output_logprobs) == 11 and all(len(t.top) == 4 for t in asking.output_logprobs)
    assert len(zero.output_logprobs) == 11 and all(t.top == () for t in zero.output_logprobs)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True])
def test_bad_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
        SamplingParams(logprobs=value)


ECHO_PROMPT = MANY_PROMPTS[2] + MANY_PROMPTS[0]


@pytest.fixture(scope="module")
def echo_reference(target_dir):
    """log_softmax of the target's logits after each prefix of ECHO_PROMPT (one throwaway prefill each)."""
    engine = tiny_engine(target_dir, eos=())
    return [None] + [torch.log_softmax(engine.next_token_logits(ECHO_PROMPT[:n]), dim=-1)
                     for n in range(1, len(ECHO_PROMPT))]


@pytest.mark.parametrize("config", [dict(), dict(max_prefill_tokens=5), dict(overlap_steps=False)],
                         ids=["whole-prompt", "chunked", "in-order"])
def test_prompt_logprobs_equal_a_direct_forward_and_skip_the_cache(target_dir, tmp_path, echo_reference, config):
    """Prompt logprobs (echo): each prompt token after the first under the target given the ones before it,
    chunked or not, with a drafter or not; the cache is not used for such a request, so every row runs."""
    for engine in (tiny_engine(target_dir, eos=(), **config),
                   spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), **config)):
        engine.generate_ids([ECHO_PROMPT], SamplingParams(max_new_tokens=3))  # caches the prompt's pages
        [request] = engine.generate_ids([ECHO_PROMPT], SamplingParams(max_new_tokens=3, prompt_logprobs=2,
                                                                      logprobs=1))
        assert request.stats.cached_tokens == 0 and len(request.prompt_logprobs) == len(ECHO_PROMPT)
        assert request.prompt_logprobs[0] is None
        for position in range(1, len(ECHO_PROMPT)):
            row, entry = echo_reference[position], request.prompt_logprobs[position]
            assert entry.token == ECHO_PROMPT[position]
            assert entry.logprob == pytest.approx(row[ECHO_PROMPT[position]].item(), abs=1e-4)
            assert [lp for _, lp in entry.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
        assert_no_leak(engine)

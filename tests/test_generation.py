"""Autoregressive generation equals transformers' generate; sampling is seeded; errors fail alone."""

import pytest
import torch

from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import PROMPTS, tiny_engine


def hf_greedy(hf, prompt, max_new_tokens, eos=None):
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_transformers_generate(tiny_model_dir):
    path, hf = tiny_model_dir
    engine = tiny_engine(path, eos=())  # no EOS: compare full-length continuations
    requests = engine.generate_ids(PROMPTS, SamplingParams(max_new_tokens=24))
    for prompt, request in zip(PROMPTS, requests):
        assert request.output_ids == hf_greedy(hf, prompt, 24, eos=[])  # noqa: list() disables eos
        assert request.finish_reason == "length"
    assert engine.pool.num_free == engine.pool.num_pages


def test_eos_stops_and_is_kept(tiny_model_dir):
    path, hf = tiny_model_dir
    free_run = tiny_engine(path, eos=()).generate_ids([PROMPTS[0]], SamplingParams(max_new_tokens=12))[0]
    eos = free_run.output_ids[5]
    stopped = tiny_engine(path, eos=(eos,)).generate_ids([PROMPTS[0]], SamplingParams(max_new_tokens=12))[0]
    first = free_run.output_ids.index(eos)
    assert stopped.output_ids == free_run.output_ids[:first + 1]
    assert stopped.finish_reason == "stop"
    ignored = tiny_engine(path, eos=(eos,)).generate_ids([PROMPTS[0]], SamplingParams(max_new_tokens=12,
                                                                                      ignore_eos=True))[0]
    assert ignored.output_ids == free_run.output_ids


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    path, _ = tiny_model_dir
    params = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    a = [r.output_ids for r in tiny_engine(path, eos=()).generate_ids(PROMPTS, params)]
    b = [r.output_ids for r in tiny_engine(path, eos=()).generate_ids(PROMPTS, params)]
    alone = tiny_engine(path, eos=()).generate_ids([PROMPTS[2]], params)[0].output_ids
    assert a == b
    assert a[2] == alone
    other_seed = tiny_engine(path, eos=()).generate_ids(PROMPTS, SamplingParams(
        max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=99))
    assert [r.output_ids for r in other_seed] != a


def test_bad_request_fails_alone(tiny_model_dir):
    path, hf = tiny_model_dir
    engine = tiny_engine(path, eos=())
    too_long = list(range(3, 60)) * 10  # 570 tokens > 512 context
    out_of_vocab = [5, 1000]
    requests = engine.generate_ids([PROMPTS[0], too_long, out_of_vocab], SamplingParams(max_new_tokens=8))
    assert requests[0].finish_reason == "length" and len(requests[0].output_ids) == 8
    assert requests[1].finish_reason == "error" and "context is 512" in requests[1].error
    assert requests[2].finish_reason == "error" and "outside the vocabulary" in requests[2].error


def test_max_model_len_holds_requests_to_a_shorter_context(tiny_model_dir, tmp_path):
    """max_model_len (vLLM's): prompt + output end at it, exactly where the model's own context would end them
    had it been that short, with a drafter too; a prompt that fills it is refused alone, and a length above the
    model's context is refused when the engine is made."""
    from tests.engine_helpers import dflash_drafter, spec_engine

    path, _ = tiny_model_dir
    free = tiny_engine(path, eos=()).generate_ids([PROMPTS[0]], SamplingParams(max_new_tokens=20))[0]
    plain = tiny_engine(path, eos=(), max_model_len=16)
    spec = spec_engine(path, dflash_drafter(path, tmp_path, 4), max_model_len=16)
    for engine in (plain, spec):
        assert engine.limits.max_context == 16
        capped, full = engine.generate_ids([PROMPTS[0], list(range(3, 19))], SamplingParams(max_new_tokens=20))
        assert capped.output_ids == free.output_ids[:16 - len(PROMPTS[0])] and capped.finish_reason == "length"
        assert full.finish_reason == "error" and "context is 16" in full.error
        assert engine.pool.num_free == engine.pool.num_pages
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_engine(path, max_model_len=513)
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_engine(path, max_model_len=1)


def test_pool_too_small_for_one_request(tiny_model_dir):
    path, _ = tiny_model_dir
    engine = tiny_engine(path, eos=(), num_kv_pages=3)
    request = engine.generate_ids([PROMPTS[0]], SamplingParams(max_new_tokens=40))[0]
    assert request.finish_reason == "error" and "KV pages" in request.error


def test_small_pool_serves_requests_in_turn(tiny_model_dir):
    path, hf = tiny_model_dir
    engine = tiny_engine(path, eos=(), num_kv_pages=12)  # room for ~one request at a time
    requests = engine.generate_ids(PROMPTS, SamplingParams(max_new_tokens=20))
    for prompt, request in zip(PROMPTS, requests):
        assert request.output_ids == hf_greedy(hf, prompt, 20, eos=[])
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)

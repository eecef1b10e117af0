"""Prefix caching is exact: with the cache on, every output equals the cache-off output (plain and DFlash,
greedy and seeded sampling, chains and trees, FP8 KV, chunked prefill), speculative equals plain, later
turns prefill only what the cache lacks, and random workloads (shared prefixes, aborts, preemption,
eviction in a small pool) end with every page free or cached and none held."""

import argparse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.arguments import add_engine_arguments, engine_options

from specdec.engine.sampling_params import SamplingParams
from tests.drafter_helpers import drafter_context
from tests.engine_helpers import (assert_no_leak, dflash_drafter, module_target, run_workload, spec_engine,
                                  tiny_engine)

SYSTEM = [(7 * i + 3) % 90 + 5 for i in range(22)]  # a shared "system prompt": 5 full pages of 4 and a part
GREEDY = SamplingParams(max_new_tokens=13)
SEEDED = SamplingParams(max_new_tokens=13, temperature=0.9, top_p=0.95, seed=1234)


target_dir = module_target("prefix-cache", seed=5)


def make_engine(path, tmp_path, drafter_block: int | None, **config):
    if drafter_block is None:
        return tiny_engine(path, eos=(), **config)
    return spec_engine(path, dflash_drafter(path, tmp_path, drafter_block), **config)


def conversation(engine, params, turns=3):
    """Turns of one conversation: each prompt resends the previous prompt and answer, plus a new message."""
    prompt, outputs, cached = list(SYSTEM), [], []
    for turn in range(turns):
        prompt = prompt + [40 + turn, 41 + 2 * turn, 9]
        request = engine.generate_ids([prompt], params)[0]
        outputs.append(request.output_ids)
        cached.append(request.stats.cached_tokens)
        prompt = prompt + request.output_ids
    return outputs, cached


@pytest.mark.parametrize("drafter_block", [None, 4])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_later_turns_reuse_the_cache_and_answer_exactly_as_without_it(target_dir, tmp_path, drafter_block, params):
    on = make_engine(target_dir, tmp_path, drafter_block)
    off = make_engine(target_dir, tmp_path, drafter_block, enable_prefix_caching=False)
    got, cached = conversation(on, params)
    expected, cached_off = conversation(off, params)
    assert got == expected
    assert cached_off == [None] * 3 and off.prefix_cache is None
    assert cached[0] == 0 and all(c >= len(SYSTEM) // 4 * 4 for c in cached[1:])  # at least the system prompt
    assert on.prefix_cache.hit_tokens == sum(cached) > 0
    assert_no_leak(on)
    assert_no_leak(off)


def test_speculative_equals_plain_decoding_with_the_cache_on(target_dir, tmp_path):
    assert conversation(make_engine(target_dir, tmp_path, 4), GREEDY)[0] == \
        conversation(make_engine(target_dir, tmp_path, None), GREEDY)[0]


def test_the_first_block_after_a_hit_drafts_as_without_the_cache(target_dir, tmp_path):
    """The drafter's context of the cached pages is the one written for the earlier request: after the
    prefill the request's whole context equals the cache-off one, and so do its acceptance lengths."""
    prompt = SYSTEM + [44, 45, 9]
    contexts, lengths = {}, {}
    for caching in (True, False):
        engine = make_engine(target_dir, tmp_path, 8, enable_prefix_caching=caching)
        engine.generate_ids([SYSTEM + [50, 51]], GREEDY)  # another request shares the system prompt
        request = engine.add_request(prompt, GREEDY)
        engine.step()  # its prefill
        assert (request.stats.cached_tokens or 0) == (20 if caching else 0)
        contexts[caching] = drafter_context(engine, request)
        while engine.has_unfinished_requests:
            engine.step()
        lengths[caching] = request.stats.acceptance_lengths
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(contexts[True], contexts[False], strict=True))
    assert contexts[True][0].shape[0] == 2 * len(prompt)
    assert lengths[True] == lengths[False]


@pytest.mark.parametrize("config", [dict(verify="tree", tree_nodes=9), dict(kv_cache_dtype="fp8"),
                                    dict(max_prefill_tokens=5), dict(page_size=1), dict(page_size=16)],
                         ids=["tree", "fp8", "chunked", "page1", "page16"])
def test_trees_fp8_chunked_prefill_and_page_sizes_stay_exact(target_dir, tmp_path, config):
    on = make_engine(target_dir, tmp_path, 4, **config)
    off = make_engine(target_dir, tmp_path, 4, enable_prefix_caching=False, **config)
    got, cached = conversation(on, GREEDY)
    assert got == conversation(off, GREEDY)[0]
    assert cached[-1] > 0
    assert_no_leak(on)


def test_requests_arriving_while_others_decode_share_a_system_prompt(target_dir, tmp_path):
    """The step API: the first request's prompt pages are cached after its prefill step, so requests that
    arrive while it decodes prefill only their own part."""
    engine = make_engine(target_dir, tmp_path, 4)
    first = engine.add_request(SYSTEM + [60], GREEDY)
    engine.step()
    later = []
    while engine.has_unfinished_requests:
        if len(later) < 4:
            later.append(engine.add_request(SYSTEM + [61 + len(later), 9], GREEDY))
        engine.step()
    assert all(r.stats.cached_tokens == 20 for r in later)
    reference = make_engine(target_dir, tmp_path, None, enable_prefix_caching=False)
    assert [r.output_ids for r in [first, *later]] == [
        r.output_ids for r in reference.generate_ids([r.prompt_ids for r in [first, *later]], GREEDY)]
    assert_no_leak(engine)


def test_a_full_pool_evicts_cached_pages_instead_of_refusing_work(target_dir, tmp_path):
    engine = make_engine(target_dir, tmp_path, 4, num_kv_pages=24)
    for i in range(6):  # each conversation's pages stay cached until the pool needs them
        engine.generate_ids([[5 + i] * 30 + [9]], GREEDY)
    assert engine.prefix_cache.num_cached > 0
    big = engine.generate_ids([list(range(5, 80))], SamplingParams(max_new_tokens=10))[0]
    assert big.finish_reason == "length"
    assert_no_leak(engine)


SHARED = [SYSTEM[:9], SYSTEM[:17], [70, 71, 72, 73, 74, 75, 76]]


@st.composite
def workloads(draw):
    """Arrivals (prompt = a shared base + own tokens, arrival step), aborts (request, step), pool size."""
    arrivals = draw(st.lists(st.tuples(st.sampled_from(range(len(SHARED))), st.lists(st.integers(5, 90), max_size=6),
                                       st.integers(0, 6), st.integers(1, 12)), min_size=1, max_size=7))
    aborts = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 10)), max_size=2))
    return arrivals, aborts, draw(st.sampled_from([14, 24, 200])), draw(st.sampled_from([4, 64]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_random_workloads_end_with_every_page_free_or_cached(target_dir, tmp_path, workload):
    arrivals, aborts, num_pages, prefill_budget = workload
    engine = make_engine(target_dir, tmp_path, 4, num_kv_pages=num_pages, max_num_seqs=3,
                         max_prefill_tokens=prefill_budget)
    requests = run_workload(engine, [(at, lambda base=base, own=own, max_new=max_new: [engine.add_request(
        SHARED[base] + own, SamplingParams(max_new_tokens=max_new))]) for base, own, at, max_new in arrivals], aborts)
    assert_no_leak(engine)
    finished = [r for r in requests if r.finish_reason == "length"]
    reference = tiny_engine(target_dir, eos=(), enable_prefix_caching=False)
    for request in finished:  # each answer is the one a fresh, cache-less engine gives
        assert request.output_ids == reference.generate_ids([request.prompt_ids], request.params)[0].output_ids


@pytest.mark.parametrize("drafter_block", [None, 4])
def test_a_reset_drops_what_no_request_holds_and_the_next_prompts_prefill_whole(target_dir, tmp_path, drafter_block):
    """`reset_prefix_cache` between calls empties the cache (both pools with a drafter): the same prompt then finds
    nothing cached and answers as before. Pages a running request holds stay cached and are found again."""
    engine = make_engine(target_dir, tmp_path, drafter_block)
    prompt = SYSTEM + [60, 9]
    first = engine.generate_ids([prompt], GREEDY)[0]
    assert engine.generate_ids([prompt], GREEDY)[0].stats.cached_tokens == 20  # the 5 full pages of the prompt
    assert engine.reset_prefix_cache() > 0 and engine.prefix_cache.num_cached == 0
    again = engine.generate_ids([prompt], GREEDY)[0]
    assert again.stats.cached_tokens == 0 and again.output_ids == first.output_ids
    assert_no_leak(engine)
    running = engine.add_request(prompt, GREEDY)
    engine.step()  # its prefill: its prompt's full pages are cached, and it holds them
    engine.reset_prefix_cache()
    assert engine.prefix_cache.num_cached >= 5
    later = engine.add_request(prompt, GREEDY)
    while engine.has_unfinished_requests:
        engine.step()
    assert later.stats.cached_tokens == 20 and running.output_ids == later.output_ids == first.output_ids
    assert_no_leak(engine)
    assert make_engine(target_dir, tmp_path, drafter_block, enable_prefix_caching=False).reset_prefix_cache() == 0


def test_the_flags_turn_caching_off():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_options(parser.parse_args([]))["enable_prefix_caching"] is True
    assert engine_options(parser.parse_args(["--no-prefix-caching"]))["enable_prefix_caching"] is False

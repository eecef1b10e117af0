"""Speculative decoding is exact: greedy output equals autoregressive output, token for token;
rollback leaves the target cache as a fresh prefill would and no page leaks."""

import pytest
import torch

from specdec.engine import decoding
from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB, build_tiny_model
from tests.drafter_helpers import ScriptedDrafter
from tests.engine_helpers import (MANY_PROMPTS, assert_no_leak, dflash_drafter, follow_the_target, spec_engine,
                                  tiny_engine)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"spec-{request.param}")
    build_tiny_model(request.param, path, seed=3)
    return path


def ar_outputs(path, prompts, max_new, eos=()):
    requests = tiny_engine(path, eos=eos).generate_ids(prompts, SamplingParams(max_new_tokens=max_new))
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_dflash_greedy_equals_autoregressive(target_dir, tmp_path, batch, block_size):
    prompts = MANY_PROMPTS[:batch]
    max_new = 23  # not a multiple of any block size: the last step ends mid-block
    expected = ar_outputs(target_dir, prompts, max_new)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, block_size))
    got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=max_new))
    assert [r.output_ids for r in got] == expected
    assert all(r.finish_reason == "length" and r.stats.verify_steps > 0 for r in got)
    assert_no_leak(engine)


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "drafted-ahead"])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_deep_acceptance_of_a_dflash_drafter_stays_exact(target_dir, tmp_path, batch, overlap, error_rate, kv):
    """A DFlash drafter whose drafts follow the target (`follow_the_target`), each wrong with `error_rate`: steps accept
    runs of drafts, so they keep several drafts' K/V, write several context rows and queue the next draft from them;
    outputs stay plain decoding's and no page leaks."""
    prompts, max_new = MANY_PROMPTS[:batch], 37
    expected = [r.output_ids for r in tiny_engine(target_dir, eos=(), kv_cache_dtype=kv).generate_ids(
        prompts, SamplingParams(max_new_tokens=max_new + 8))]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 8), overlap_steps=overlap, kv_cache_dtype=kv,
                         max_num_seqs=max(1, batch - 1))  # the last one arrives later
    follow_the_target(engine.drafter, {tuple(p): e for p, e in zip(prompts, expected)}, error_rate)
    got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=max_new))
    assert [r.output_ids for r in got] == [e[:max_new] for e in expected]
    assert max(n for r in got for n in r.stats.acceptance_lengths) >= (8 if error_rate == 0 else 4)
    assert_no_leak(engine)


def test_a_draft_window_changes_the_drafts_alone(target_dir, tmp_path):
    """draft_window: the drafter attends only so far back, so its drafts on a long prompt change (a window longer
    than the prompt changes nothing); what is committed still equals autoregressive output."""
    prompt = [int(t) for t in torch.randint(3, VOCAB - 3, (41,), generator=torch.Generator().manual_seed(5))]
    expected = ar_outputs(target_dir, [prompt], 19)

    def first_drafts(window: int) -> torch.Tensor:
        engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), draft_window=window,
                             overlap_steps=False)
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=19))
        engine.step()  # the prefill, in order: the whole prompt is the drafter's context, its first token committed
        logits = engine.drafter.draft_logits([request]).clone()
        engine.abort(request.request_id)
        got = engine.generate_ids([prompt], SamplingParams(max_new_tokens=19))
        assert [r.output_ids for r in got] == expected
        assert_no_leak(engine)
        return logits

    whole = first_drafts(0)
    torch.testing.assert_close(first_drafts(100), whole)
    assert not torch.allclose(first_drafts(5), whole, atol=1e-4)


@pytest.mark.parametrize("config", [dict(verify="chain"), dict(verify="tree", tree_nodes=7),
                                    dict(verify="auto", max_num_seqs=3), dict(verify="chain", max_prefill_tokens=9)],
                         ids=["chain", "tree", "auto", "chunked"])
def test_a_small_draft_window_stays_exact_everywhere(target_dir, tmp_path, config):
    """A window far shorter than the prompts, with trees, auto's choices, chunked prefill and the prefix cache:
    greedy output equals autoregressive output, and no page leaks."""
    prompts = MANY_PROMPTS + [MANY_PROMPTS[0] + [7] * 20]  # the last shares the first's prefix (a cache hit)
    expected = ar_outputs(target_dir, prompts, 21)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), draft_window=3, num_kv_pages=1024,
                         **config)
    assert engine.drafter.attn.window_left == 3
    got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=21))
    assert [r.output_ids for r in got] == expected
    assert_no_leak(engine)


def test_the_default_draft_window_is_the_one_the_drafter_declares(target_dir, tmp_path):
    drafter = dflash_drafter(target_dir, tmp_path, 4)
    drafter.draft_window = 7  # as a drafter config's dflash_config.draft_window sets it
    assert spec_engine(target_dir, drafter).drafter.attn.window_left == 7
    drafter = dflash_drafter(target_dir, tmp_path, 4)
    drafter.draft_window = 7
    assert spec_engine(target_dir, drafter, draft_window=0).drafter.attn.window_left == -1  # 0: the whole context
    assert spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4)).drafter.attn.window_left == -1


def test_deeper_drafter_reading_more_target_layers_is_lossless(target_dir, tmp_path):
    """A grown drafter's shape (3 draft layers, 3 target layers): greedy output still equals autoregressive."""
    prompts = MANY_PROMPTS[:3]
    expected = ar_outputs(target_dir, prompts, 23)
    drafter = dflash_drafter(target_dir, tmp_path, 4, num_layers=3, target_layer_ids=[0, 1, 2])
    engine = spec_engine(target_dir, drafter)
    got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=23))
    assert [r.output_ids for r in got] == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("mode,tau", [("right", "full"), ("wrong", 1.0), ("noisy", None)])
def test_scripted_acceptance_extremes_stay_exact(target_dir, block_size, mode, tau):
    max_new = 37
    expected = ar_outputs(target_dir, MANY_PROMPTS, max_new)
    script = {tuple(p): e for p, e in zip(MANY_PROMPTS, expected)}
    drafter = ScriptedDrafter(script, block_size, VOCAB, wrong=mode == "wrong",
                              error_rate=0.15 if mode == "noisy" else 0.0)
    engine = spec_engine(target_dir, drafter)
    got = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=max_new))
    assert [r.output_ids for r in got] == expected
    for r in got:
        lengths = r.stats.acceptance_lengths
        if mode == "right":  # every step but possibly the last accepts the whole block
            assert all(n == block_size for n in lengths[:-1])
        elif mode == "wrong":
            assert lengths == [1] * len(lengths) and r.stats.tau == tau
    assert_no_leak(engine)
    assert not drafter.live


def test_eos_inside_accepted_run_ends_there(target_dir):
    free = ar_outputs(target_dir, MANY_PROMPTS, 30)
    eos = free[0][9]  # a token that appears mid-run in the first continuation
    expected = ar_outputs(target_dir, MANY_PROMPTS, 30, eos=(eos,))
    script = {tuple(p): e for p, e in zip(MANY_PROMPTS, free)}
    engine = spec_engine(target_dir, ScriptedDrafter(script, 8, VOCAB), eos=(eos,))
    got = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=30))
    assert [r.output_ids for r in got] == expected
    assert got[0].finish_reason == "stop" and got[0].output_ids[-1] == eos
    assert_no_leak(engine)


@pytest.mark.parametrize("max_new", [1, 12])
@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_first_tokens_are_read_before_the_drafter_gets_the_prompt(target_dir, tmp_path, max_new, overlap, monkeypatch):
    """A streamed answer's first token waits for the prefill alone: in order, it is committed before the drafter's
    context write for that prompt is launched; overlapped, its copy to the host is queued before that write (the next
    step reads it). Answers stay those of plain decoding (also when the first token ends one)."""
    prompts = MANY_PROMPTS[:3]
    expected = ar_outputs(target_dir, prompts, max_new)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), overlap_steps=overlap)
    events, add_context = [], engine.drafter.add_context

    def recorded_add_context(requests, features, lens):
        events.extend(("context", r.request_id) for r in requests)
        return add_context(requests, features, lens)

    class RecordedCopy(decoding.HostCopy):  # the overlapped step's tokens on their way to the host
        def __init__(self, tensor):
            events.append(("copy", tuple(tensor.tolist())))
            super().__init__(tensor)

    monkeypatch.setattr(decoding, "HostCopy", RecordedCopy)
    engine.drafter.add_context = recorded_add_context
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts]
    while engine.has_unfinished_requests:
        engine.step(on_commit=lambda request, tokens: events.append(("commit", request.request_id)))
    for request in requests:
        first = events.index(("context", request.request_id))
        if overlap:  # the last copy before it holds the first tokens of the step's prompts, this one's among them
            copied = next(value for kind, value in reversed(events[:first]) if kind == "copy")
            assert request.output_ids[0] in copied and ("commit", request.request_id) not in events[:first]
        else:
            assert ("commit", request.request_id) in events[:first]
    assert [r.output_ids for r in requests] == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_a_failing_first_token_callback_leaves_the_drafter_context_level_with_the_target(target_dir, tmp_path,
                                                                                         overlap):
    """The drafter's context is written after the first tokens' commits in order (before them overlapped), and also
    when the caller's on_commit raises there: the step fails, but no request's drafter context falls behind its
    target KV."""
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), overlap_steps=overlap)
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in MANY_PROMPTS[:3]]

    def failing(request, tokens):
        raise RuntimeError("the caller failed")

    with pytest.raises(RuntimeError, match="the caller failed"):
        for _ in range(2):  # overlapped, the next step commits the first tokens
            engine.step(on_commit=failing)
    for request in requests:
        assert engine.drafter.context_table(request).length == request.target_pages.length == len(request.prompt_ids)
    engine.abort_all(requests)
    engine.step()  # retires what the abort ended
    assert_no_leak(engine)


def committed_kv(engine, request, layer):
    """K/V the target cache holds for request positions 0 .. num_cached-1."""
    table = request.target_pages
    n = table.length
    pages = torch.tensor([table.pages[p // table.pool.page_size] for p in range(n)])
    offsets = torch.tensor([p % table.pool.page_size for p in range(n)])
    return engine.kv.layers[layer].read(pages, offsets, torch.float32)


def test_rollback_leaves_cache_equal_to_fresh_prefill(target_dir):
    max_new = 40
    expected = ar_outputs(target_dir, MANY_PROMPTS, max_new)
    script = {tuple(p): e for p, e in zip(MANY_PROMPTS, expected)}
    engine = spec_engine(target_dir, ScriptedDrafter(script, 6, VOCAB, error_rate=0.2, seed=5))
    fresh = tiny_engine(target_dir, eos=())
    decode, checked = engine._decode, []

    def checked_decode(running, on_commit, chunks=None):
        decode(running, on_commit, chunks)
        for request in running:
            if request.finished:
                continue
            committed = request.all_ids[:-1]  # all but the pending token have K/V
            assert request.num_cached == len(committed)
            probe = fresh.make_request(committed, SamplingParams(max_new_tokens=1))
            fresh._prepare(probe)
            fresh.forward_tokens([probe], fresh.ids_tensor(committed), [len(committed)], logits_rows=None)
            for layer in (0, engine.model.num_layers - 1):
                for ours, ref in zip(committed_kv(engine, request, layer), committed_kv(fresh, probe, layer)):
                    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
            probe.target_pages.free()
            checked.append(request.request_id)

    engine._decode = checked_decode
    got = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=max_new))
    assert [r.output_ids for r in got] == expected
    assert len(checked) > 20
    assert_no_leak(engine)
    assert fresh.pool.num_free == fresh.pool.num_pages


def test_a_verify_step_takes_no_page_back_that_its_rollback_gave_away(target_dir):
    """A verify writes a block past the committed length and rolls back to what it accepts: the pages of the
    next block stay with the request, so the pool is asked for a page only when the committed tokens reach a
    new one (not at every step whose block crosses a page), and outputs are unchanged."""
    max_new, page_size = 40, 4
    expected = ar_outputs(target_dir, MANY_PROMPTS, max_new)
    script = {tuple(p): e for p, e in zip(MANY_PROMPTS, expected)}
    engine = spec_engine(target_dir, ScriptedDrafter(script, 6, VOCAB, error_rate=0.5, seed=7), page_size=page_size)
    pool, taken = engine.pool, []
    take = pool.take
    pool.take = lambda count: (taken.append(count), take(count))[1]
    requests = [engine.make_request(p, SamplingParams(max_new_tokens=max_new)) for p in MANY_PROMPTS]
    engine.run(requests)
    assert [r.output_ids for r in requests] == expected
    # each request's pages: those of its prompt and answer, and of one block past them at most
    most = sum(pool.pages_for(len(p) + max_new + 6) for p in MANY_PROMPTS)
    assert sum(r.stats.verify_steps for r in requests) > 2 * len(requests)
    assert sum(taken) <= most
    assert_no_leak(engine)


def test_random_batches_leak_no_pages(target_dir, tmp_path):
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4, seed=1), num_kv_pages=40,
                         max_num_seqs=3)
    g = torch.Generator().manual_seed(0)
    for round_ in range(3):
        prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
                   for n in torch.randint(1, 20, (6,), generator=g)]
        limits = torch.randint(1, 30, (6,), generator=g).tolist()
        requests = [engine.make_request(p, SamplingParams(max_new_tokens=m)) for p, m in zip(prompts, limits)]
        engine.run(requests)
        assert [len(r.output_ids) for r in requests] == limits
        assert_no_leak(engine)


@pytest.mark.parametrize("calibrate", [False, True])
def test_fp8_kv_speculative_equals_fp8_autoregressive(target_dir, tmp_path, calibrate):
    config = dict(kv_cache_dtype="fp8", drafter_kv_cache_dtype="fp8", calibrate_fp8_scales=calibrate)
    ar = tiny_engine(target_dir, eos=(), **config)
    expected = [r.output_ids for r in ar.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=21))]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), **config)
    got = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=21))
    assert [r.output_ids for r in got] == expected
    scales = {layer.k_scale for layer in engine.kv.layers} | {layer.k_scale for layer in engine.drafter.kv.layers}
    assert (scales != {1.0}) == calibrate
    assert_no_leak(engine)


def test_dropped_engine_is_freed_without_garbage_collection(target_dir, tmp_path):
    """No reference cycle holds an engine: its KV pool (GPU memory) goes as soon as it is dropped."""
    import gc
    import weakref

    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4))
    engine.generate_ids(MANY_PROMPTS[:2], SamplingParams(max_new_tokens=5))
    alive = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert alive() is None
    finally:
        gc.enable()

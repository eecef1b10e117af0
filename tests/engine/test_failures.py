"""Failures stay contained: an exception anywhere in a generation call (a component, a callback,
Ctrl-C) leaves the engine exactly as clean as before the call, with what each request had committed."""

import random
import threading

import pytest

from specdec.engine import speculator
from specdec.engine.sampling_params import SamplingParams
from tests.conftest import build_tiny_model_with_tokenizer
from tests.engine_helpers import MANY_PROMPTS, dflash_drafter, failing_at, module_target, spec_engine


class Injected(Exception):
    pass


def assert_clean(engine):
    assert engine.pool.num_free == engine.pool.num_pages
    if engine.drafter is not None:
        assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages
        assert not engine.drafter.tables and not engine.drafter.pending
    assert engine.scheduler.idle


# ---- the engine: an exception injected at a random point of a random batch -----------------------
POINTS = ("prefill", "draft", "verify", "sampling", "callback")


def inject(engine, point: str, after: int, interrupt: bool):
    """Make the `after`-th call at `point` raise (KeyboardInterrupt when `interrupt`). Returns on_commit."""
    failing = failing_at(after, (KeyboardInterrupt if interrupt else Injected)(point))

    if point == "prefill":
        engine.runner.run_prefill = failing(engine.runner.run_prefill)
    elif point == "draft":
        engine.drafter.propose = failing(engine.drafter.propose)
    elif point == "verify":
        engine.runner.run_block = failing(engine.runner.run_block)
    elif point == "sampling":  # the speculative phase samples the verify's rows (undone by the caller)
        speculator.sample_block = failing(speculator.sample_block)
    return failing(lambda request, tokens: None) if point == "callback" else None


target_dir = module_target("failures", seed=5)


def test_exception_at_a_random_point_leaves_the_engine_clean(target_dir, tmp_path):
    params = SamplingParams(max_new_tokens=13)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), num_kv_pages=96, max_num_seqs=3)
    probe = [[7, 8, 9], [40, 41, 42, 43, 44]]
    fresh = [r.output_ids for r in spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4))
             .generate_ids(probe, params)]
    rng = random.Random(0)
    for trial in range(25):
        point, after, interrupt = rng.choice(POINTS), rng.randint(1, 4), rng.random() < 0.5
        prompts = rng.sample(MANY_PROMPTS, rng.randint(1, len(MANY_PROMPTS)))
        fresh_engine_methods = (engine.runner.run_prefill, engine.drafter.propose, engine.runner.run_block,
                                speculator.sample_block)
        on_commit = inject(engine, point, after, interrupt)
        requests = [engine.make_request(p, params) for p in prompts]
        try:
            engine.run(requests, on_commit)
        except (Injected, KeyboardInterrupt):
            assert all(r.finished for r in requests)
            assert any(r.finish_reason == "abort" for r in requests)
        finally:  # undo the injection
            (engine.runner.run_prefill, engine.drafter.propose, engine.runner.run_block,
             speculator.sample_block) = fresh_engine_methods
        assert_clean(engine)
        assert [r.output_ids for r in engine.generate_ids(probe, params)] == fresh, (trial, point, after)
        assert_clean(engine)


def test_committed_tokens_survive_an_abort(target_dir, tmp_path):
    """What a request committed before the interruption is kept, and is a prefix of its full output."""
    params = SamplingParams(max_new_tokens=12)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4))
    full = [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:3], params)]
    inject(engine, "verify", 3, interrupt=True)
    requests = [engine.make_request(p, params) for p in MANY_PROMPTS[:3]]
    with pytest.raises(KeyboardInterrupt):
        engine.run(requests)
    for request, want in zip(requests, full):
        assert request.finish_reason == "abort" and 0 < len(request.output_ids) < len(want)
        assert request.output_ids == want[:len(request.output_ids)]
    assert_clean(engine)


# ---- the library: the reported reproduction, partial results, threads -----------------------------
@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("failures-llm")
    build_tiny_model_with_tokenizer(path)
    return path


def make_llm(path):
    from specdec import LLM

    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=64, page_size=4)


def test_interrupt_in_a_callback_keeps_the_llm_usable(llm_dir):
    llm, params = make_llm(llm_dir), SamplingParams(max_new_tokens=16)

    def on_text(i, text):
        if i == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        llm.generate([[5, 6, 7], [10, 11], [100], [40, 41]], params, on_text=on_text)
    partial = caught.value.partial_results
    assert len(partial) == 4 and {r.finish_reason for r in partial} <= {"abort", "length", "stop"}
    assert any(r.finish_reason == "abort" for r in partial)
    assert_clean(llm.engine)
    again = llm.generate([[9, 9]], SamplingParams(max_new_tokens=4))
    assert again[0].token_ids == make_llm(llm_dir).generate([[9, 9]], SamplingParams(max_new_tokens=4))[0].token_ids


def test_threads_sharing_one_llm_run_one_call_at_a_time(llm_dir):
    llm, params = make_llm(llm_dir), SamplingParams(max_new_tokens=10)
    prompts = [[[5, 6, 7], [8]], [[10, 11, 12]], [[100, 101], [40, 41, 42]], [[60]]]
    want = [[r.token_ids for r in llm.generate(p, params)] for p in prompts]
    got = [None] * len(prompts)

    def worker(i):
        got[i] = [r.token_ids for r in llm.generate(prompts[i], params)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == want
    assert_clean(llm.engine)


def test_generate_from_inside_a_callback_is_refused(llm_dir):
    llm = make_llm(llm_dir)

    def on_finish(i, result):
        llm.generate([[1, 2]], SamplingParams(max_new_tokens=2))

    with pytest.raises(RuntimeError, match="inside one of its own callbacks"):
        llm.generate([[5, 6]], SamplingParams(max_new_tokens=3), on_finish=on_finish)
    assert_clean(llm.engine)


def test_a_prefix_cache_reset_between_calls_empties_it_and_one_from_a_callback_is_refused(llm_dir):
    llm, params = make_llm(llm_dir), SamplingParams(max_new_tokens=3)
    prompt = list(range(5, 17))  # 3 full pages of 4
    first = llm.generate([prompt], params)[0]
    assert llm.engine.prefix_cache.num_cached > 0
    with pytest.raises(RuntimeError, match="inside a generate callback"):
        llm.generate([prompt], params, on_finish=lambda i, result: llm.reset_prefix_cache())
    assert_clean(llm.engine)
    assert llm.reset_prefix_cache() > 0 and llm.engine.prefix_cache.num_cached == 0
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == first.token_ids and again.stats.cached_tokens == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=1e-39), "temperature must be 0"), (dict(temperature="0.5"), "temperature"),
    (dict(stop=5), "stop must be a string"), (dict(seed=2**70), "seed must be an integer"),
])
def test_sampling_values_that_would_fail_mid_run_are_refused_up_front(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


"""Continuous batching: requests join and leave between steps, long prompts are prefilled in chunks, a
full pool preempts the newest request, and none of it changes a single output token or leaks a page."""

import random

import pytest

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB, build_tiny_model
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, spec_engine


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("scheduling")
    build_tiny_model("qwen3", path, seed=11)
    return path


@pytest.fixture(scope="module")
def drafter_dir(target_dir, tmp_path_factory):
    return tmp_path_factory.mktemp("scheduling-drafter")


OVERLAP = "overlap"  # plain decoding with overlapped steps (specdec/engine/flight.py)
AHEAD = "ahead"  # DFlash, each step's next draft queued before its tokens are read (Drafter.propose_next)
MODES = pytest.mark.parametrize("speculative", [False, True, OVERLAP, AHEAD],
                                ids=["ar", "dflash", "ar-overlapped", "dflash-ahead"])


def make_engine(target_dir, drafter_dir, speculative, **config):
    """speculative: False (plain decoding), True (DFlash), OVERLAP (plain decoding, overlapped steps) or AHEAD
    (DFlash drafting ahead)."""
    if speculative == OVERLAP:
        return spec_engine(target_dir, None, overlap_steps=True, **config)
    drafter = dflash_drafter(target_dir, drafter_dir, 4) if speculative else None
    return spec_engine(target_dir, drafter, overlap_steps=speculative == AHEAD, **config)


def alone(target_dir, drafter_dir, speculative, prompts, params_list):
    """Each request run by itself on a roomy engine, one step after the other: what every schedule must
    reproduce (overlapped steps included)."""
    engine = make_engine(target_dir, drafter_dir, speculative in (True, AHEAD))
    return [engine.generate_ids([p], params)[0].output_ids for p, params in zip(prompts, params_list)]


def drain(engine, limit=10_000):
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests:
            return outputs
        outputs.append(engine.step())
    raise AssertionError("the engine did not finish in time")


def assert_drafter_mirrors_target(engine):
    """The drafter's context cache never holds more pages than the target's (why one check suffices)."""
    if engine.drafter is not None:
        assert engine.drafter.pool.num_pages - engine.drafter.pool.num_free <= engine.pool.num_pages - engine.pool.num_free


LONG = [list(range(3, 60)), [(7 * i) % (VOCAB - 3) + 3 for i in range(90)]]
PARAMS = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=25, temperature=0.9, seed=4)]


@MODES
def test_requests_join_between_steps_and_match_running_alone(target_dir, drafter_dir, speculative):
    prompts = MANY_PROMPTS[:6]
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    expected = alone(target_dir, drafter_dir, speculative, prompts, params)
    engine = make_engine(target_dir, drafter_dir, speculative, max_num_seqs=4)
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):  # one new request every other step
        requests.append(engine.add_request(prompt, p))
        engine.step()
        if i % 2:
            engine.step()
    steps = drain(engine)
    assert [r.output_ids for r in requests] == expected
    committed = {}
    for out in steps:
        for request, tokens in out.committed:
            committed.setdefault(request.request_id, []).extend(tokens)
    # what the steps reported adds up to each output (the tail of it: the first steps ran above)
    assert all(r.output_ids[len(r.output_ids) - len(committed.get(r.request_id, [])):] == committed.get(r.request_id, [])
               for r in requests)
    assert_no_leak(engine)


@MODES
def test_full_pool_preempts_and_recomputes_with_identical_output(target_dir, drafter_dir, speculative):
    prompts = MANY_PROMPTS + LONG
    params = [SamplingParams(max_new_tokens=40)] * 5 + [PARAMS[1]] * (len(prompts) - 5)
    expected = alone(target_dir, drafter_dir, speculative, prompts, params)
    # 48 pages of 4 slots: two long requests alone fill most of it
    engine = make_engine(target_dir, drafter_dir, speculative, num_kv_pages=48, max_num_seqs=8)
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(10_000):
        if not engine.has_unfinished_requests:
            break
        engine.step()
        assert_drafter_mirrors_target(engine)
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.stats.preemptions for r in requests) == engine.scheduler.num_preemptions
    assert [r.output_ids for r in requests] == expected
    assert all(r.finish_reason == "length" for r in requests)
    assert_no_leak(engine)


def count_target_forwards(engine) -> list:
    """Record every forward of the target (any kind: each runs its decoder layers once) from now on."""
    calls = []
    model = engine.runner.model
    real = model.hidden_states
    model.hidden_states = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1]
    return calls


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "dflash"])
def test_long_prompt_is_prefilled_in_chunks_while_others_decode(target_dir, drafter_dir, speculative):
    expected = alone(target_dir, drafter_dir, speculative, [MANY_PROMPTS[0], LONG[1]], PARAMS)
    engine = make_engine(target_dir, drafter_dir, speculative, max_prefill_tokens=8)
    short = engine.add_request(MANY_PROMPTS[0], PARAMS[0])
    engine.step()
    engine.step()
    assert short.decoding
    long = engine.add_request(LONG[1], PARAMS[1])
    forwards = count_target_forwards(engine)
    chunks = 0
    while not long.output_ids:
        before = len(short.output_ids)
        out = engine.step()
        chunks += 1
        assert len(forwards) == chunks  # the chunk rode along the decode (or verify) forward
        assert long.num_cached <= 8 * chunks  # never more than the budget per step
        assert short.finished or len(short.output_ids) > before  # decoding went on during the prefill
        assert all(request is not long or tokens for request, tokens in out.committed)
    assert chunks == -(-len(LONG[1]) // 8)
    drain(engine)
    assert [short.output_ids, long.output_ids] == expected
    assert_no_leak(engine)


def test_abort_frees_pages_at_once_and_keeps_committed_output(target_dir, drafter_dir):
    engine = make_engine(target_dir, drafter_dir, True, max_num_seqs=2)
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=30)) for p in MANY_PROMPTS[:4]]
    for _ in range(3):
        engine.step()
    running, waiting = engine.scheduler.running[0], engine.scheduler.waiting[-1]
    held = running.target_pages.num_pages
    free_before = engine.pool.num_free
    committed = list(running.output_ids)
    assert engine.abort(running.request_id) is running and running.finish_reason == "abort"
    assert running.output_ids == committed and engine.pool.num_free == free_before + held
    assert running.request_id not in engine.drafter.tables
    assert engine.abort(waiting.request_id) is waiting and waiting not in engine.scheduler.waiting
    assert engine.abort(running.request_id) is None and engine.abort(12345) is None
    drain(engine)
    assert sum(r.finish_reason == "length" for r in requests) == 2
    assert_no_leak(engine)


def test_one_request_failing_while_committing_fails_alone(target_dir, drafter_dir):
    prompts = MANY_PROMPTS[:3]
    expected = alone(target_dir, drafter_dir, True, prompts, [SamplingParams(max_new_tokens=20)] * 3)
    engine = make_engine(target_dir, drafter_dir, True)
    requests = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    broken = requests[1]
    original = broken.commit_many

    def failing(tokens, logprobs=None):
        if len(broken.output_ids) >= 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(tokens, logprobs)

    broken.commit_many = failing
    drain(engine)
    assert broken.finish_reason == "error" and "UnicodeDecodeError" in broken.error
    assert broken.output_ids == expected[1][:len(broken.output_ids)]
    assert [requests[0].output_ids, requests[2].output_ids] == [expected[0], expected[2]]
    assert_no_leak(engine)


@MODES
def test_random_schedules_are_exact_and_leak_nothing(target_dir, drafter_dir, speculative):
    """Random arrivals, aborts, pool sizes and prefill budgets: every finished request equals its solo run,
    every aborted one holds a prefix of it, and the pools are full again at the end."""
    rng = random.Random({True: 7, False: 8, OVERLAP: 9, AHEAD: 10}[speculative])
    reference = make_engine(target_dir, drafter_dir, speculative in (True, AHEAD))
    for trial in range(4):
        engine = make_engine(target_dir, drafter_dir, speculative, num_kv_pages=rng.randint(30, 60),
                             max_num_seqs=rng.randint(2, 6), max_prefill_tokens=rng.randint(3, 40))
        pending = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 70))],
                    SamplingParams(max_new_tokens=rng.randint(1, 35), temperature=rng.choice([0.0, 0.7]),
                                   seed=rng.randrange(1000)))
                   for _ in range(10)]
        requests, aborted = [], set()
        for _ in range(2_000):
            if pending and rng.random() < 0.4:
                requests.append(engine.add_request(*pending.pop()))
            if requests and rng.random() < 0.05:
                victim = rng.choice(requests)
                if engine.abort(victim.request_id) is not None:
                    aborted.add(victim.request_id)
            if not pending and not engine.has_unfinished_requests:
                break
            if engine.has_unfinished_requests:
                engine.step()
                assert_drafter_mirrors_target(engine)
        assert not pending and not engine.has_unfinished_requests
        for request in requests:
            want = reference.generate_ids([request.prompt_ids], request.params)[0].output_ids
            if request.request_id in aborted:
                assert request.finish_reason == "abort" and request.output_ids == want[:len(request.output_ids)]
            else:
                assert request.output_ids == want, (trial, request.request_id)
        assert_no_leak(engine)

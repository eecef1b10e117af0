"""Overlapped steps (plain decoding): the next step is queued before this one's tokens are read back.
They really overlap (a step commits the previous step's tokens while its own are in flight), change no
output token (greedy, seeded sampling, EOS, length limits; the scheduling tests run the same schedules
overlapped), never run a request past its length limit, and an exception anywhere leaves the engine
clean. Speculative engines keep their speculative steps in order under the setting (it makes them draft ahead:
test_draft_ahead.py); their steps of prompt chunks alone are overlapped."""

import random

import pytest

from specdec.engine import decoding
from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, failing_at, module_target, spec_engine


target_dir = module_target("overlapped", seed=21)


def overlapped(target_dir, **config):
    return spec_engine(target_dir, None, overlap_steps=True, **config)


def test_a_step_commits_the_previous_steps_tokens_while_its_own_are_in_flight(target_dir):
    engine = overlapped(target_dir)
    request = engine.add_request(MANY_PROMPTS[0], SamplingParams(max_new_tokens=5))
    out = engine.step()  # the prompt: its first token is sampled, not read back
    assert not out.committed and request.in_flight == 1 and not request.output_ids and request.decoding
    out = engine.step()  # decodes from the first token on the device, then commits it
    assert out.committed == [(request, [request.output_ids[0]])] and request.in_flight == 1
    while engine.has_unfinished_requests:
        engine.step()
    assert len(request.output_ids) == 5 and request.in_flight == 0 and engine.flight is None
    assert_no_leak(engine)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=17),
                                    SamplingParams(max_new_tokens=17, temperature=0.8, top_p=0.9, seed=3)],
                         ids=["greedy", "sampled"])
def test_outputs_equal_steps_run_one_after_the_other(target_dir, params):
    # EOS 2 and 9 end some requests early: the overlapped engine learns that a step late
    plain = spec_engine(target_dir, None, eos=(2, 9), max_num_seqs=3).generate_ids(MANY_PROMPTS, params)
    engine = spec_engine(target_dir, None, eos=(2, 9), overlap_steps=True, max_num_seqs=3)
    requests = engine.generate_ids(MANY_PROMPTS, params)
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    assert [r.finish_reason for r in requests] == [r.finish_reason for r in plain]
    assert_no_leak(engine)


def test_no_step_runs_a_request_past_its_length_limit(target_dir):
    engine = overlapped(target_dir)
    rows = []
    launch = engine.decoding.launch
    engine.decoding.launch = lambda running, prefill, carried, starting: (rows.append(len(running)),
                                                                          launch(running, prefill, carried, starting))[1]
    requests = engine.generate_ids(MANY_PROMPTS[:3], SamplingParams(max_new_tokens=4))
    assert all(len(r.output_ids) == 4 for r in requests)
    # one prefill step, then three decode steps of all three requests: no fifth token is computed
    assert rows == [0, 3, 3, 3]
    one = overlapped(target_dir).generate_ids(MANY_PROMPTS[:2], SamplingParams(max_new_tokens=1))
    assert [len(r.output_ids) for r in one] == [1, 1]


@pytest.mark.parametrize("point", ["launch", "tokens", "callback"])
def test_an_exception_anywhere_leaves_the_engine_clean(target_dir, point, monkeypatch):
    params = SamplingParams(max_new_tokens=9)
    engine = overlapped(target_dir, num_kv_pages=64, max_num_seqs=3)
    fresh = [r.output_ids for r in overlapped(target_dir).generate_ids(MANY_PROMPTS[:2], params)]
    rng = random.Random(point)
    for _ in range(6):
        failing = failing_at(rng.randint(1, 6), KeyboardInterrupt(point))
        on_commit = None
        with monkeypatch.context() as patch:
            if point == "launch":
                patch.setattr(engine.decoding, "launch", failing(engine.decoding.launch))
            elif point == "tokens":
                patch.setattr(decoding.Launched, "tokens", failing(decoding.Launched.tokens))
            else:
                on_commit = failing(lambda request, tokens: None)
            requests = [engine.make_request(p, params) for p in MANY_PROMPTS[:5]]
            try:
                engine.run(requests, on_commit)
            except KeyboardInterrupt:
                assert all(r.finished for r in requests) and any(r.finish_reason == "abort" for r in requests)
        assert engine.flight is None and engine.scheduler.idle
        assert all(r.in_flight == 0 or r.finished for r in requests)
        assert_no_leak(engine)
        assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:2], params)] == fresh


def test_speculative_engines_run_their_steps_in_order(target_dir, tmp_path):
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), overlap_steps=True)
    assert not engine.overlap
    request = engine.add_request(MANY_PROMPTS[0], SamplingParams(max_new_tokens=5))
    out = engine.step()  # a step of prompt chunks alone is overlapped: its first token is not read back yet
    assert not out.committed and request.in_flight == 1 and engine.flight is not None
    out = engine.step()  # the speculative step lands it first, then runs in order
    assert out.committed[0] == (request, [request.output_ids[0]]) and len(out.committed) == 2
    assert request.in_flight == 0 and engine.flight is None
    while engine.has_unfinished_requests:
        engine.step()
    assert len(request.output_ids) == 5
    assert_no_leak(engine)

"""The next verify, queued before its step's tokens reach the host (`SpeculativeDecoding._queue_next_verify`,
`TargetRunner.run_block_ahead`), for a lone request (`verify_ahead`) and for a batch (`verify_ahead_batches`): steps
that take it commit what steps verifying in order commit (greedy and seeded sampling, deep and no acceptance, EOS and
length limits, an FP8 cache); a step after which requests of a batch ended takes it without their rows; requests that
arrive wait one step rather than drop it, a plain or tree step in between keeps it from being used, and requests
waiting for a full batch do not keep it from being queued; failures and aborts leave nothing held. On the CPU the
queued verify reads the acceptance back and runs at its real starts; the GPU's planning for the latest starts with the
real ones on the device is tested in tests/attention/test_flashinfer_dispatch.py and tests/gpu."""

import random

import pytest

from specdec.engine import speculator
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import PLAIN, TREE
from tests.engine_helpers import (MANY_PROMPTS, assert_no_leak, count_deferred_admissions, dflash_engine,
                                  follow_the_target, lone_runs, module_target, params_for, plain_answers, run_failing,
                                  spec_engine)

target_dir = module_target("verify-ahead", seed=37)


def count_ahead(engine, monkeypatch) -> dict:
    """Counts of verifies queued ahead, of steps that took one (or found one and dropped it) and of those that took one
    with rows of requests that had ended."""
    counts = {"queued": 0, "taken": 0, "dropped": 0, "rows_left": 0, "queued_for": []}
    run_block_ahead = engine.runner.run_block_ahead

    def queue(tables, *args):
        out = run_block_ahead(tables, *args)
        counts["queued"] += out is not None
        counts["queued_for"].extend(tables)
        return out

    blocks_of = speculator.VerifiedAhead.blocks_of

    def recorded(self, running, *args):
        blocks = blocks_of(self, running, *args)
        counts["taken" if blocks is not None else "dropped"] += 1
        counts["rows_left"] += blocks is not None and len(running) < len(self.requests)
        return blocks

    engine.runner.run_block_ahead = queue
    monkeypatch.setattr(speculator.VerifiedAhead, "blocks_of", recorded)
    return counts


def ahead_against_in_order(target_dir, tmp_path, monkeypatch, setting: str, on, off, run_prompts, answers,
                           temperature: float, error_rate: float, kv: str) -> dict:
    """MANY_PROMPTS through `run_prompts` (`lone_runs` or `batch_run`) on an engine with `setting` `on` and one with it
    `off`, drafts from `answers` (plain decoding's) with `error_rate` wrong: both commit the same tokens step by step
    and end alike, the one with it off queues nothing, outputs equal plain decoding's at T=0 in the model's dtype, and
    no page leaks. Returns the counts of the engine with it on (`count_ahead`)."""
    def run(value):
        engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, kv_cache_dtype=kv, **{setting: value})
        follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, answers)}, error_rate)
        counts = count_ahead(engine, monkeypatch)
        requests = run_prompts(engine, MANY_PROMPTS, temperature)
        assert_no_leak(engine)
        return requests, counts

    ahead, counts = run(on)
    in_order, in_order_counts = run(off)
    assert [r.output_ids for r in ahead] == [r.output_ids for r in in_order]
    assert [r.stats.acceptance_lengths for r in ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert [r.finish_reason for r in ahead] == [r.finish_reason for r in in_order]
    assert in_order_counts["queued"] == 0
    if temperature == 0.0 and kv == "auto":
        assert [r.output_ids for r in ahead] == [r.output_ids for r in answers]
    return counts


def arriving_every_third_step(engine, answers, monkeypatch) -> tuple[list, dict, list[bool]]:
    """MANY_PROMPTS added one every third step (greedy, request i ending after 6 + 5i tokens), drafts from `answers`
    with a fifth wrong; returns the requests, the verifies queued ahead (`count_ahead`) and the admissions deferred
    (`count_deferred_admissions`), counted from the start."""
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, answers)}, 0.2)
    counts, deferred = count_ahead(engine, monkeypatch), count_deferred_admissions(engine)
    requests = []
    for i, prompt in enumerate(MANY_PROMPTS):
        requests.append(engine.add_request(prompt, params_for(i, 0.0)))
        for _ in range(3):
            engine.step()
    return requests, counts, deferred


@pytest.mark.parametrize("temperature,error_rate,kv", [(0.0, 0.0, "auto"), (0.0, 0.3, "auto"), (0.0, 1.0, "auto"),
                                                       (0.8, 0.3, "auto"), (0.0, 0.3, "fp8")])
def test_a_lone_requests_verifies_queued_ahead_commit_what_verifies_in_order_commit(target_dir, tmp_path, monkeypatch,
                                                                                    temperature, error_rate, kv):
    """Requests alone, drafts from the target's own answers (none to all of them accepted), drafted ahead, the cache
    in the model's dtype or FP8: every step commits what it commits when each verify is planned after its step's
    tokens are read, outputs equal plain decoding's (at T=0, the model's dtype), and no page leaks."""
    counts = ahead_against_in_order(target_dir, tmp_path, monkeypatch, "verify_ahead", True, False, lone_runs,
                                    plain_answers(target_dir, MANY_PROMPTS), temperature, error_rate, kv)
    assert counts["taken"] > 5 and counts["taken"] >= counts["queued"] - len(MANY_PROMPTS)


def test_requests_that_join_wait_a_step_for_a_queued_verify_and_a_full_batch_queues_them_for_its_lone_request(
        target_dir, tmp_path, monkeypatch):
    """Requests arriving every third step while a verify is queued for a lone one join the step after the one that takes
    it (none is dropped). With room for one request at a time the others wait without being able to join, so each
    request in turn gets its verifies queued ahead, and only a request's last step queues one that is dropped (the next
    request's prompt comes instead). Outputs stay those of plain decoding."""
    answers = plain_answers(target_dir, MANY_PROMPTS)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=True)
    requests, counts, deferred = arriving_every_third_step(engine, answers, monkeypatch)
    while engine.has_unfinished_requests:
        engine.step()
    assert [r.output_ids for r in requests] == [r.output_ids for r in answers]
    assert counts["dropped"] == 0 and counts["taken"] > 0 and sum(deferred) > 0
    assert_no_leak(engine)

    one_at_a_time = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=True, max_num_seqs=1)
    counts = count_ahead(one_at_a_time, monkeypatch)
    requests = [one_at_a_time.make_request(p, params_for(i, 0.0)) for i, p in enumerate(MANY_PROMPTS[:3])]
    one_at_a_time.run(requests)
    assert [r.output_ids for r in requests] == [r.output_ids for r in answers[:3]]
    assert {id(t) for t in counts["queued_for"]} == {id(r.target_pages) for r in requests}
    assert counts["taken"] > 3 * counts["dropped"] and counts["dropped"] <= len(requests)
    assert_no_leak(one_at_a_time)


def test_plain_and_tree_steps_between_drop_a_queued_verify(target_dir, tmp_path, monkeypatch):
    """auto picking chains of 4 and 2, plain steps and token trees at random for a lone request: a verify queued for
    a chain step is not used by a later one after a plain or tree step, and outputs equal plain decoding's."""
    answers = plain_answers(target_dir, MANY_PROMPTS)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=True, verify="auto")
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, answers)}, 0.2)
    rng = random.Random(5)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: rng.choice(
        [4, 2] + ([TREE] if trees else []) + ([PLAIN] if plain else []))
    counts = count_ahead(engine, monkeypatch)
    decoding, after_queued = engine.decoding, []  # the kinds of steps that came after a verify was queued
    step, launch = decoding.step, decoding.launch

    def speculative(*args):
        queued = decoding.ahead is not None
        tokens = step(*args)
        if queued:
            after_queued.append(TREE if decoding.option == TREE else "chain")
        return tokens

    def plain(*args):
        if decoding.ahead is not None:
            after_queued.append(PLAIN)
        return launch(*args)

    decoding.step, decoding.launch = speculative, plain
    requests = lone_runs(engine, MANY_PROMPTS, 0.0)
    assert [r.output_ids for r in requests] == [r.output_ids for r in answers]
    assert counts["taken"] > 0 and {TREE, PLAIN, "chain"} <= set(after_queued)
    assert_no_leak(engine)


@pytest.mark.parametrize("point", ["run_block_ahead", "run_block"])
def test_a_failure_around_a_verify_queued_ahead_leaves_the_engine_clean(target_dir, tmp_path, point):
    """Queueing the next verify, or a verify after one, fails: the request ends, no page leaks, and the engine then
    gives what a fresh one gives."""
    params = SamplingParams(max_new_tokens=14)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=True)
    fresh = [r.output_ids for r in dflash_engine(target_dir, tmp_path, overlap_steps=False).generate_ids(
        MANY_PROMPTS[:1], params)]
    interrupted = [run_failing(engine, engine.runner, point, after, MANY_PROMPTS[:1], params) for after in (1, 2, 3)]
    assert any(interrupted)
    assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:1], params)] == fresh


def test_an_abort_after_a_verify_was_queued_ahead_leaves_nothing_held(target_dir, tmp_path, monkeypatch):
    """A lone request aborted between steps, with the next verify queued for it: it gives everything back, and the
    next request runs as on a fresh engine."""
    params = SamplingParams(max_new_tokens=30)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=True)
    counts = count_ahead(engine, monkeypatch)
    request = engine.add_request(MANY_PROMPTS[2], params)
    for _ in range(20):
        engine.step()
        if counts["queued"]:
            break
    assert counts["queued"] and not request.finished
    engine.abort(request.request_id)
    assert_no_leak(engine)
    fresh = dflash_engine(target_dir, tmp_path, overlap_steps=False).generate_ids(MANY_PROMPTS[:2], params)
    assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:2], params)] == [r.output_ids for r in fresh]


@pytest.mark.parametrize("ahead", [True, False])
def test_block_steps_write_a_lone_verifys_rows_from_its_start_only_with_verify_ahead(target_dir, tmp_path, ahead):
    """With verify_ahead a block step's body (what a graph rung captures) first has the backend make a lone
    verify's query rows' page metadata from the start in its inputs (`use_device_rows`, a no-op on the torch
    backend): a verify queued ahead, planned for a later start, gets its real start's there. Without it, never."""
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=ahead)
    runner, kv_lens = engine.runner, []
    ends = lambda: {int(inputs["starts"][0]) + q for q, inputs in runner.inputs.items()}  # noqa: E731
    runner.attn.use_device_rows = lambda kv_len: kv_lens.append((int(kv_len[0]), ends()))
    engine.generate_ids([MANY_PROMPTS[0]], SamplingParams(max_new_tokens=12))
    assert runner.verify_ahead is ahead
    assert bool(kv_lens) is ahead and all(kv_len in step_ends for kv_len, step_ends in kv_lens)


def batch_run(engine, prompts, temperature: float) -> list:
    """All prompts at once (request i ending after 6 + 5i tokens, or at EOS)."""
    requests = [engine.make_request(p, params_for(i, temperature)) for i, p in enumerate(prompts)]
    engine.run(requests)
    return requests


@pytest.mark.parametrize("temperature,error_rate,kv", [(0.0, 0.0, "auto"), (0.0, 0.3, "auto"), (0.0, 1.0, "auto"),
                                                       (0.8, 0.3, "auto"), (0.0, 0.3, "fp8")])
def test_a_batchs_verifies_queued_ahead_commit_what_verifies_in_order_commit(target_dir, tmp_path, monkeypatch,
                                                                            temperature, error_rate, kv):
    """Every prompt at once, each request ending at its own step (length limits, EOS), drafts from the target's own
    answers (none to all accepted), the cache in the model's dtype or FP8: with `verify_ahead_batches` a batch's
    steps take verifies queued ahead, those after which a request ended without its rows, and every step
    commits what it commits when each verify is planned after its step's tokens are read; at T=0 in the model's
    dtype, outputs equal plain decoding's. No page leaks."""
    counts = ahead_against_in_order(target_dir, tmp_path, monkeypatch, "verify_ahead_batches", "on", "off", batch_run,
                                    batch_run(spec_engine(target_dir, None, eos=(2, 9)), MANY_PROMPTS, 0.0),
                                    temperature, error_rate, kv)
    assert counts["taken"] > 1 and counts["rows_left"] > 0
    assert len(counts["queued_for"]) > len(MANY_PROMPTS)  # whole batches


def test_requests_joining_a_batch_wait_a_step_for_its_queued_verify_and_aborts_leave_nothing_held(target_dir,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """Requests arriving every third step while a verify is queued for the running batch join the step after the one
    that takes it, whose chunks complete their prompts and which queues the next verify with them in it; a request
    aborted between steps with a verify queued for its batch gives everything back; the others' outputs are plain
    decoding's."""
    answers = batch_run(spec_engine(target_dir, None, eos=(2, 9)), MANY_PROMPTS, 0.0)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead_batches="on")
    queue, with_new = engine.decoding._queue_next_verify, []

    def queued(running, *args):  # a verify queued by a step that completed prompts: their requests have no output yet
        out = queue(running, *args)
        with_new.append(out is not None and any(not r.output_ids for r in running))
        return out

    engine.decoding._queue_next_verify = queued
    requests, counts, deferred = arriving_every_third_step(engine, answers, monkeypatch)
    assert any(with_new)  # a step whose chunks completed prompts queued the next verify, the new requests in it
    aborted = requests[-1]
    for _ in range(20):
        if engine.decoding.ahead is not None and not aborted.finished:
            break
        engine.step()
    assert engine.decoding.ahead is not None and aborted in engine.decoding.ahead.requests
    engine.abort(aborted.request_id)
    while engine.has_unfinished_requests:
        engine.step()
    assert [r.output_ids for r in requests[:-1]] == [r.output_ids for r in answers[:-1]]
    assert aborted.output_ids == answers[-1].output_ids[:len(aborted.output_ids)]
    assert counts["taken"] > 0 and sum(deferred) > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("pages", [20, 24, 32])
def test_a_batch_that_preempts_with_verifies_queued_ahead_stays_exact_and_gives_every_page_back(target_dir, tmp_path,
                                                                                           monkeypatch, pages):
    """Every prompt at once in a pool too small for all: requests are preempted and recomputed around steps that take
    verifies queued ahead, which are queued only where the pool holds their pages. Outputs equal plain decoding's and
    every page ends free."""
    answers = batch_run(spec_engine(target_dir, None, eos=(2, 9)), MANY_PROMPTS, 0.0)
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead_batches="on", num_kv_pages=pages)
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, answers)}, 0.2)
    counts = count_ahead(engine, monkeypatch)
    requests = batch_run(engine, MANY_PROMPTS, 0.0)
    assert [r.output_ids for r in requests] == [r.output_ids for r in answers]
    assert engine.scheduler.num_preemptions > 0 and counts["taken"] > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("point", ["run_block_ahead", "run_block"])
def test_a_failure_around_a_batchs_verify_queued_ahead_leaves_the_engine_clean(target_dir, tmp_path, point):
    """Queueing a batch's next verify, or a verify after one, fails: every request ends, no page leaks, and the engine
    then gives what a fresh one gives."""
    params = SamplingParams(max_new_tokens=14)
    prompts = MANY_PROMPTS[:4]
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead_batches="on")
    fresh = [r.output_ids for r in dflash_engine(target_dir, tmp_path, overlap_steps=False).generate_ids(prompts,
                                                                                                          params)]
    interrupted = [run_failing(engine, engine.runner, point, after, prompts, params) for after in (1, 2, 3)]
    assert any(interrupted)
    assert [r.output_ids for r in engine.generate_ids(prompts, params)] == fresh


@pytest.mark.parametrize("setting", ["on", "auto", "off"])
def test_block_steps_of_a_batch_write_its_real_page_metadata_only_with_verify_ahead_batches(target_dir, tmp_path,
                                                                                          setting):
    """With verify_ahead_batches on a batch's block step body (what a graph rung captures) has the backend make the
    page metadata of every request's length after the step from the starts in its inputs (`use_device_lengths`, a
    no-op on the torch backend and on rungs that split the KV); a lone request's steps never do. Off, never; auto is
    on only on CUDA, so off here."""
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead_batches=setting)
    runner, seen = engine.runner, []
    ends = lambda: {q: (inputs["starts"][:8] + q).tolist() for q, inputs in runner.inputs.items()}  # noqa: E731
    runner.attn.use_device_lengths = lambda kv_lens: seen.append((kv_lens.tolist(), ends()))
    engine.generate_ids(MANY_PROMPTS[:3], SamplingParams(max_new_tokens=12))
    engine.generate_ids(MANY_PROMPTS[:1], SamplingParams(max_new_tokens=12))
    assert runner.verify_ahead_batches is (setting == "on")
    assert bool(seen) is (setting == "on")
    assert all(len(kv_lens) > 1 and any(kv_lens == step_ends[:len(kv_lens)] for step_ends in by_q.values())
               for kv_lens, by_q in seen)

"""Drafting ahead: each chain step queues the next step's draft before its own tokens are read back
(`Drafter.propose_next`). On CPU the drafter reads the acceptance back to plan it exactly (the GPU plans
upper bounds and reads the real lengths on the device: tests/gpu), so a draft made ahead must be exactly the
draft a step would have made itself: the same tokens committed per step, the same outputs, no page leaked,
whatever joins, leaves, fails or switches to a token tree."""

import random

import pytest

from specdec.engine import decoding
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import TREE, StepCosts
from tests.conftest import VOCAB
from tests.engine_helpers import (MANY_PROMPTS, assert_no_leak, dflash_engine, module_target, run_failing,
                                  run_staggered, spec_engine)


target_dir = module_target("draft-ahead", seed=31)


def engine_for(target_dir, tmp_path, ahead: bool, **config):
    return dflash_engine(target_dir, tmp_path, overlap_steps=ahead, **config)


def count_ahead(engine) -> dict:
    """Counts of drafts queued ahead (and of the requests among them that the step started), and of steps whose
    batch took some (`partly`), all or none of its drafts from them."""
    counts = {"queued": 0, "starters": 0, "partly": 0, "wholly": 0, "none": 0}
    drafter = engine.drafter
    propose_next, propose = drafter.propose_next, drafter.propose

    def queue(requests, anchors, committed, rows, most, length=None, **options):
        queued = propose_next(requests, anchors, committed, rows, most, length, **options)
        counts["queued"] += queued
        counts["starters"] += queued * most.count(0)  # requests whose prompts the step completed
        return queued

    def take(requests, length=None):
        ahead = sum(r.request_id in drafter.queued for r in requests)
        kind = "wholly" if ahead == len(requests) else "partly" if ahead else "none"
        counts[kind] = counts.get(kind, 0) + 1
        return propose(requests, length)

    drafter.propose_next, drafter.propose = queue, take
    return counts


def run_many_staggered(engine, temperature: float) -> list:
    """MANY_PROMPTS joining every other step, request i ending after 8 + 5i tokens (seeded sampling at
    `temperature`); the engine is left with no page leaked."""
    params = [SamplingParams(max_new_tokens=8 + 5 * i, temperature=temperature, seed=i)
              for i in range(len(MANY_PROMPTS))]
    requests = run_staggered(engine, MANY_PROMPTS, params)
    assert_no_leak(engine)
    return requests


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_steps_drafted_ahead_commit_what_steps_drafted_in_order_commit(target_dir, tmp_path, temperature):
    """Requests join every other step and end at different steps (EOS, limits); chunked prompts ride along, and
    the draft queued by the step that completes a prompt includes that request's first draft."""
    def run(ahead):
        engine = engine_for(target_dir, tmp_path, ahead, max_num_seqs=4, max_prefill_tokens=9)
        counts = count_ahead(engine) if ahead else None
        return run_many_staggered(engine, temperature), counts

    ahead, counts = run(True)
    in_order, _ = run(False)
    assert [r.output_ids for r in ahead] == [r.output_ids for r in in_order]
    assert [r.finish_reason for r in ahead] == [r.finish_reason for r in in_order]
    # the same drafts: every step commits the same tokens
    assert [r.stats.acceptance_lengths for r in ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert counts["queued"] > 10 and counts["wholly"] > 5 and counts["starters"] >= 4


def test_a_small_pool_preempts_and_still_matches(target_dir, tmp_path):
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outputs, preempted = [], []
    for ahead in (True, False):
        engine = engine_for(target_dir, tmp_path, ahead, num_kv_pages=24, max_num_seqs=4)
        requests = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished_requests:
            preempted += engine.step().preempted
        assert_no_leak(engine)
        outputs.append([r.output_ids for r in requests])
    assert outputs[0] == outputs[1] and preempted


def test_a_batch_partly_drafted_ahead_drafts_the_rest_itself(target_dir, tmp_path, monkeypatch):
    """Requests that join without a queued draft (here: the requests a step starts are left out of its queued
    draft) are drafted by the step itself, beside the queued drafts of the others."""
    prompts, params = MANY_PROMPTS[:6], SamplingParams(max_new_tokens=20)
    expected = [r.output_ids for r in engine_for(target_dir, tmp_path, False).generate_ids(prompts, params)]
    engine = engine_for(target_dir, tmp_path, True, max_num_seqs=4, max_prefill_tokens=9)
    prefilled = engine.decoding._prefilled
    monkeypatch.setattr(engine.decoding, "_prefilled", lambda prefill: (prefilled(prefill), None)[1])
    counts = count_ahead(engine)
    requests = []
    for prompt in prompts:  # a new request every step, its prompt riding along the decode of the others
        requests.append(engine.add_request(prompt, params))
        engine.step()
    while engine.has_unfinished_requests:
        engine.step()
    assert [r.output_ids for r in requests] == expected
    assert counts["partly"] > 0 and counts["starters"] == 0
    assert_no_leak(engine)


def test_a_step_that_runs_a_token_tree_drafts_again(target_dir, tmp_path):
    """auto switching between chains and trees: a tree step drafts its candidates itself (the context the queued
    draft wrote stays), and outputs stay those of plain decoding."""
    plain = spec_engine(target_dir, None, eos=(2, 9)).generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=20))
    engine = engine_for(target_dir, tmp_path, True, verify="auto", max_num_seqs=8)
    rng = random.Random(0)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: rng.choice(
        [TREE, 4] if trees else [4])
    counts = count_ahead(engine)
    requests = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=20))
    assert [r.output_ids for r in requests] == [r.output_ids for r in plain]
    assert counts["queued"] > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_token_tree_steps_queue_the_next_trees_candidates(target_dir, tmp_path, temperature):
    """verify="tree": a tree step without prompt chunks queues the next step's draft with candidates before its
    readback, and the next tree step of the same batch takes it; steps after arrivals or departures draft again.
    Every step commits what it commits when each tree step drafts for itself, outputs equal plain decoding's at
    T=0, and no page leaks."""
    def run(ahead):
        engine = engine_for(target_dir, tmp_path, ahead, verify="tree", max_num_seqs=4, max_prefill_tokens=9)
        drafter, taken = engine.drafter, {"ahead": 0, "again": 0}
        propose_candidates = drafter.propose_candidates

        def take(requests):
            whole = drafter.queued_candidates and [drafter.queued.get(r.request_id) for r in requests] == list(
                range(len(requests)))
            taken["ahead" if whole else "again"] += 1
            return propose_candidates(requests)

        drafter.propose_candidates = take
        return run_many_staggered(engine, temperature), taken

    ahead, taken = run(True)
    in_order, in_order_taken = run(False)
    assert [r.output_ids for r in ahead] == [r.output_ids for r in in_order]
    assert [r.stats.acceptance_lengths for r in ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert taken["ahead"] > 5 and taken["again"] > 0 and in_order_taken["ahead"] == 0
    if temperature == 0.0:
        plain = spec_engine(target_dir, None, eos=(2, 9))
        want = run_staggered(plain, MANY_PROMPTS, [SamplingParams(max_new_tokens=8 + 5 * i)
                                                   for i in range(len(MANY_PROMPTS))])
        assert [r.output_ids for r in ahead] == [r.output_ids for r in want]


def test_a_queued_draft_scores_the_drafts_the_policy_picks_for_the_next_step(target_dir, tmp_path):
    """auto with costs that verify 2 tokens a request at 3 or more requests and the whole block (4) below, and
    requests that end one after another: each queued draft scores as many drafts as the policy picks for the batch
    it drafts (1 or 3), a step that takes queued drafts verifies no more than they hold, and outputs equal plain
    decoding's."""
    def run(engine):
        requests = [engine.make_request(prompt, SamplingParams(max_new_tokens=6 + 5 * i))
                    for i, prompt in enumerate(MANY_PROMPTS)]
        engine.run(requests)
        return [r.output_ids for r in requests]

    plain = run(spec_engine(target_dir, None, eos=(2, 9)))
    engine = engine_for(target_dir, tmp_path, True, verify="auto", max_num_seqs=4)
    rungs = (1, 2, 3, 4)
    engine.decoding.policy.costs = StepCosts(draft={}, verify={2: dict.fromkeys(rungs, 1.0),
                                                               4: {r: 1.0 if r < 3 else 100.0 for r in rungs}})
    drafter, queued, taken = engine.drafter, [], []
    propose_next, propose = drafter.propose_next, drafter.propose

    def queue(requests, anchors, committed, rows, most, length=None, **options):
        queued.append((len(requests), length))
        return propose_next(requests, anchors, committed, rows, most, length, **options)

    def take(requests, length=None):
        taken.append((length, drafter.queued_length))
        return propose(requests, length)

    drafter.propose_next, drafter.propose = queue, take
    assert run(engine) == plain
    assert {length for _, length in queued} == {1, 3}
    assert all(length == (1 if batch >= 3 else 3) for batch, length in queued)
    assert all(held is None or length <= held for length, held in taken)
    assert (3, 3) in taken  # the tail's steps took whole-block drafts queued for them
    assert_no_leak(engine)


@pytest.mark.parametrize("verify", ["chain", "tree"])
@pytest.mark.parametrize("point", ["propose_next", "settle"])
def test_an_exception_around_a_draft_ahead_leaves_the_engine_clean(target_dir, tmp_path, point, verify):
    """A draft queued ahead (for a chain, or a tree's candidates) whose queueing or settling fails: every request
    of the call ends, no page leaks, and the engine then gives what a fresh one gives."""
    params = SamplingParams(max_new_tokens=12)
    engine = engine_for(target_dir, tmp_path, True, num_kv_pages=64, max_num_seqs=3, verify=verify)
    fresh = [r.output_ids for r in engine_for(target_dir, tmp_path, False, verify=verify).generate_ids(
        MANY_PROMPTS[:3], params)]
    rng = random.Random(point)
    for _ in range(4):
        run_failing(engine, engine.drafter, point, rng.randint(1, 5), MANY_PROMPTS[:5], params)
    assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:3], params)] == fresh


@pytest.mark.parametrize("verify", ["chain", "tree"])
def test_a_steps_tokens_start_to_the_host_before_the_next_draft_is_queued(target_dir, tmp_path, monkeypatch, verify):
    """A step that drafts ahead queues its tokens' copy to the host before the next step's draft, and reads them
    after: the read then waits for the step alone while the GPU drafts (a chain's draft, a tree's candidates)."""
    engine = engine_for(target_dir, tmp_path, True, verify=verify, max_num_seqs=4)
    events = []

    class RecordedCopy(decoding.HostCopy):
        def __init__(self, tensor):
            events.append("copy")
            super().__init__(tensor)

        def tolist(self):
            events.append("read")
            return super().tolist()

    monkeypatch.setattr(decoding, "HostCopy", RecordedCopy)
    propose_next = engine.drafter.propose_next

    def queue(*args, **options):
        queued = propose_next(*args, **options)
        events.append("draft" if queued else "no draft")
        return queued

    engine.drafter.propose_next = queue
    requests = engine.generate_ids(MANY_PROMPTS[:3], SamplingParams(max_new_tokens=12))
    drafts = [i for i, event in enumerate(events) if event == "draft"]
    assert len(drafts) > 3 and all(r.finished for r in requests)
    assert all(events[i - 1] == "copy" and events[i + 1] == "read" for i in drafts), events

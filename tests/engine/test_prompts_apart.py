"""A speculative chain step's prompt chunks in a forward of their own after its verify (`prompts_apart`,
`SpeculativeDecoding._prefill_apart`): steps that admit prompts while others decode commit what one mixed forward
commits (greedy and seeded sampling, no to full acceptance, chunked prompts, logprobs, an FP8 cache, drafting ahead or
not), at T=0 what plain decoding commits; the drafter drafts from the verify's features moved past the chunks', and
nothing is left held, after an interrupt in the chunks' forward too."""

import pytest

from tests import engine_helpers
from tests.engine_helpers import (MANY_PROMPTS, assert_logprobs_close, assert_no_leak, count_deferred_admissions,
                                  dflash_engine, follow_the_target, module_target, params_for, run_staggered)

target_dir = module_target("prompts-apart", seed=41)


@pytest.fixture(scope="module")
def plain_answers(target_dir):
    return engine_helpers.plain_answers(target_dir, MANY_PROMPTS)


def staggered_run(target_dir, tmp_path, plain_answers, apart: bool, temperature: float, error_rate: float,
                  logprobs: int | None = None, **config) -> tuple[list, int]:
    """MANY_PROMPTS joining while earlier ones decode (`run_staggered`), drafts from plain decoding's answers with
    `error_rate` wrong; returns the requests and the number of steps whose chunks ran in a forward of their own while
    others were verified."""
    engine = dflash_engine(target_dir, tmp_path, prompts_apart=apart, **config)
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, plain_answers)},
                      error_rate)
    apart_steps, verified = [0], [False]  # steps with chunks apart; whether this step has verified yet
    run_prefill, run_block, step = engine.runner.run_prefill, engine.runner.run_block, engine.step

    def block(*args):
        verified[0] = True
        return run_block(*args)

    def prefill_alone(prefill):
        apart_steps[0] += verified[0]
        return run_prefill(prefill)

    def stepped(*args, **kwargs):
        verified[0] = False
        return step(*args, **kwargs)

    engine.runner.run_block, engine.runner.run_prefill, engine.step = block, prefill_alone, stepped
    requests = run_staggered(engine, MANY_PROMPTS,
                             [params_for(i, temperature, logprobs) for i in range(len(MANY_PROMPTS))])
    assert_no_leak(engine)
    return requests, apart_steps[0]


@pytest.mark.parametrize("temperature,error_rate,kv,overlap", [
    (0.0, 0.0, "auto", True), (0.0, 0.3, "auto", True), (0.0, 1.0, "auto", True), (0.8, 0.3, "auto", True),
    (0.0, 0.3, "fp8", True), (0.0, 0.3, "auto", False)])
def test_prompt_chunks_apart_from_the_verify_commit_what_one_mixed_forward_commits(target_dir, tmp_path, plain_answers,
                                                                                   temperature, error_rate, kv,
                                                                                   overlap):
    """Requests join while others decode (each join a step with a prompt chunk beside the running requests' verify):
    with the chunks in a forward of their own every request commits what it commits when one forward runs both, step
    by step; at T=0 in the model's dtype, plain decoding's tokens."""
    config = dict(kv_cache_dtype=kv, overlap_steps=overlap)
    apart, apart_steps = staggered_run(target_dir, tmp_path, plain_answers, True, temperature, error_rate, **config)
    mixed, mixed_steps = staggered_run(target_dir, tmp_path, plain_answers, False, temperature, error_rate, **config)
    assert apart_steps >= 4 and mixed_steps == 0
    assert [r.output_ids for r in apart] == [r.output_ids for r in mixed]
    assert [r.stats.acceptance_lengths for r in apart] == [r.stats.acceptance_lengths for r in mixed]
    assert [r.finish_reason for r in apart] == [r.finish_reason for r in mixed]
    if temperature == 0.0 and kv == "auto":
        assert [r.output_ids for r in apart] == [r.output_ids for r in plain_answers]


def test_chunked_prompts_apart_from_the_verify(target_dir, tmp_path, plain_answers):
    """Prompts longer than a step's token budget, prefilled in chunks over several steps beside the verifies of those
    decoding: the same tokens as one mixed forward, and plain decoding's."""
    config = dict(max_prefill_tokens=5)
    apart, apart_steps = staggered_run(target_dir, tmp_path, plain_answers, True, 0.0, 0.3, **config)
    mixed, _ = staggered_run(target_dir, tmp_path, plain_answers, False, 0.0, 0.3, **config)
    assert apart_steps >= 6
    assert [r.output_ids for r in apart] == [r.output_ids for r in mixed] == [r.output_ids for r in plain_answers]


def test_logprobs_of_steps_with_prompts_apart(target_dir, tmp_path, plain_answers):
    """Requests asking for logprobs of their prompts and answers: the same as one mixed forward's."""
    apart, _ = staggered_run(target_dir, tmp_path, plain_answers, True, 0.0, 0.3, logprobs=3)
    mixed, _ = staggered_run(target_dir, tmp_path, plain_answers, False, 0.0, 0.3, logprobs=3)
    for a, m in zip(apart, mixed):
        assert a.output_ids == m.output_ids
        assert_logprobs_close(a.output_logprobs, m.output_logprobs)
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(a.prompt_ids)
        assert_logprobs_close(a.prompt_logprobs[1:], m.prompt_logprobs[1:])


@pytest.mark.parametrize("overlap,ahead", [(True, "off"), (False, "off"), (True, "on")])
def test_the_drafter_drafts_from_the_verifys_features_moved_past_the_chunks(target_dir, tmp_path, overlap, ahead):
    """The random drafter's own drafts (nothing scripted), step by step: the same with the chunks apart as with one
    mixed forward and verifies in order, so each request's context rows came from its own verify rows (drafting
    ahead, from the features in the buffer; in order, from the rows the step hands the drafter; with verifies queued
    ahead, from the queued verify's rows, those of requests that ended since among them)."""
    def drafts_of(apart: bool) -> list:
        engine = dflash_engine(target_dir, tmp_path, prompts_apart=apart, overlap_steps=overlap,
                               verify_ahead_batches=ahead if apart else "off")
        proposed, propose = [], engine.drafter.propose

        def recorded(requests, *args, **kwargs):
            drafts = propose(requests, *args, **kwargs)
            proposed.append(drafts[:len(requests)].tolist())
            return drafts

        engine.drafter.propose = recorded
        run_staggered(engine, MANY_PROMPTS, [params_for(i, 0.0) for i in range(len(MANY_PROMPTS))])
        assert_no_leak(engine)
        return proposed

    apart, mixed = drafts_of(True), drafts_of(False)
    assert len(apart) > 20 and apart == mixed



@pytest.mark.parametrize("owner,point", [("runner", "run_prefill"), ("decoding", "_prefilled")])
def test_a_failure_in_a_prompts_forward_apart_leaves_the_engine_clean(target_dir, tmp_path, plain_answers, owner,
                                                                      point):
    """Three requests at a time, each ending at its own length, so that prompts join while others are verified: an
    interrupt in the chunks' own forward or in what follows it (the drafter's context, the first tokens) at such a
    step ends the call's requests and leaves no page held, and the engine then answers as plain decoding does."""
    engine = dflash_engine(target_dir, tmp_path, prompts_apart=True, max_num_seqs=3)
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, plain_answers)}, 0.3)
    target, original = getattr(engine, owner), getattr(getattr(engine, owner), point)
    for after in (1, 2, 3):
        calls = {"apart": 0}

        def failing(prefill, *args, **kwargs):  # the after-th call on chunks run beside others' verifies
            calls["apart"] += prefill is not None and len(engine.scheduler.running) > len(prefill.requests)
            if calls["apart"] == after:
                raise KeyboardInterrupt(point)
            return original(prefill, *args, **kwargs)

        setattr(target, point, failing)
        requests = [engine.make_request(p, params_for(i, 0.0)) for i, p in enumerate(MANY_PROMPTS)]
        try:
            with pytest.raises(KeyboardInterrupt):
                engine.run(requests)
        finally:
            setattr(target, point, original)
        assert all(r.finished for r in requests) and engine.scheduler.idle
        assert_no_leak(engine)
    answers = [engine.generate_ids([p], params_for(i, 0.0))[0] for i, p in enumerate(MANY_PROMPTS)]
    assert [a.output_ids for a in answers] == [a.output_ids for a in plain_answers]


@pytest.mark.parametrize("temperature,error_rate,kv,chunk", [
    (0.0, 0.0, "auto", 64), (0.0, 0.3, "auto", 64), (0.0, 1.0, "auto", 64), (0.8, 0.3, "auto", 64),
    (0.0, 0.3, "fp8", 64), (0.0, 0.3, "auto", 5)])
def test_verifies_queued_ahead_serve_steps_whose_prompt_chunks_run_apart(target_dir, tmp_path, plain_answers,
                                                                         monkeypatch, temperature, error_rate, kv,
                                                                         chunk):
    """With the chunks apart, a request that arrives joins at once and the verify queued for the others serves that
    step (on the CPU every batch queues one: `verify_ahead_batches="on"`); a step whose chunks do not yet complete a
    prompt queues the next one too. Every request commits what it commits with verifies in order and one mixed forward,
    step by step; at T=0 in the model's dtype, plain decoding's tokens."""
    from specdec.engine import speculator

    config = dict(kv_cache_dtype=kv, overlap_steps=True, max_prefill_tokens=chunk)
    taken, blocks_of = [], speculator.VerifiedAhead.blocks_of

    def recorded(self, running, prefill, *args, **kwargs):
        blocks = blocks_of(self, running, prefill, *args, **kwargs)
        taken.append((prefill is not None, blocks is not None))
        return blocks

    monkeypatch.setattr(speculator.VerifiedAhead, "blocks_of", recorded)
    engine = dflash_engine(target_dir, tmp_path, prompts_apart=True, verify_ahead_batches="on", **config)
    follow_the_target(engine.drafter, {tuple(p): a.output_ids for p, a in zip(MANY_PROMPTS, plain_answers)},
                      error_rate)
    deferred = count_deferred_admissions(engine)
    ahead = run_staggered(engine, MANY_PROMPTS, [params_for(i, temperature) for i in range(len(MANY_PROMPTS))])
    assert_no_leak(engine)
    in_order, _ = staggered_run(target_dir, tmp_path, plain_answers, False, temperature, error_rate,
                                verify_ahead_batches="off", **config)
    assert not any(deferred)
    assert sum(with_chunks and used for with_chunks, used in taken) >= 3
    assert [r.output_ids for r in ahead] == [r.output_ids for r in in_order]
    assert [r.stats.acceptance_lengths for r in ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert [r.finish_reason for r in ahead] == [r.finish_reason for r in in_order]
    if temperature == 0.0 and kv == "auto":
        assert [r.output_ids for r in ahead] == [r.output_ids for r in plain_answers]

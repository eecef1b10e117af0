"""Plain decoding steps in a DFlash engine (verify="auto": the policy's PLAIN, where no draft pays): they run overlapped
as plain decoding's do while the drafter's context keeps up, so that switching between plain steps, chains and token
trees at any step leaves every output equal to plain decoding's and no page leaked, whatever joins, leaves, is
preempted or aborted."""

import random
from collections import Counter

import pytest
import torch

from drafters import dflash
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import PLAIN, TREE, StepCosts, VerifyPolicy, verify_lengths
from tests import engine_helpers
from tests.conftest import VOCAB
from tests.drafter_helpers import drafter_context, write_step_context_at_once
from tests.engine_helpers import (MANY_PROMPTS, assert_logprobs_close, assert_no_leak, first_draft_logits,
                                  module_target, run_staggered, spec_engine)

EOS = (2, 9)


target_dir = module_target("plain-steps", seed=31)


def dflash_engine(target_dir, tmp_path, **config):
    """The shared DFlash engine of these tests, verifying with `auto` unless told otherwise."""
    return engine_helpers.dflash_engine(target_dir, tmp_path, **{"verify": "auto", **config})


def plain_outputs(target_dir, prompts, params_list) -> list[list[int]]:
    """Each prompt decoded alone by plain decoding."""
    engine = spec_engine(target_dir, None, eos=EOS)
    return [engine.generate_ids([p], params)[0].output_ids for p, params in zip(prompts, params_list)]


def random_choices(engine, seed: int, options: tuple[int, ...]) -> Counter:
    """The policy's choice replaced by a seeded random one among `options` (of those the call allows); counts the
    plain steps launched and the speculative steps run."""
    rng = random.Random(seed)
    decoding = engine.decoding
    counts = Counter()

    def choose(batch, nodes=0, trees=True, plain=True, budgets=True):
        return rng.choice([o for o in options if (trees or o != TREE) and (plain or o != PLAIN)])

    launch, step = decoding.launch, decoding.step

    def counted_launch(*args, **kwargs):
        counts["plain"] += 1
        return launch(*args, **kwargs)

    def counted_step(*args, **kwargs):
        counts["speculative"] += 1
        return step(*args, **kwargs)

    decoding.policy.choose, decoding.launch, decoding.step = choose, counted_launch, counted_step
    return counts


@pytest.mark.parametrize("options", [(PLAIN, 2, 4), (PLAIN, 4, TREE)], ids=["chains", "trees"])
def test_switching_between_plain_steps_and_speculation_keeps_plain_decodings_outputs(target_dir, tmp_path, options):
    """Requests join every other step with chunked prompts riding along, and end at different steps (EOS, limits)."""
    params_list = [SamplingParams(max_new_tokens=8 + 5 * i) for i in range(len(MANY_PROMPTS))]
    want = plain_outputs(target_dir, MANY_PROMPTS, params_list)
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4, max_prefill_tokens=9, tree_nodes=6)
    counts = random_choices(engine, 0, options)
    requests = run_staggered(engine, MANY_PROMPTS, params_list)
    assert [r.output_ids for r in requests] == want
    assert counts["plain"] > 5 and counts["speculative"] > 5
    assert_no_leak(engine)


def test_the_policy_learns_overheads_only_from_steady_steps_and_switch_costs_from_the_others(target_dir, tmp_path):
    """The engine tells the policy each step's kind and hands it the wall time of every decode-only step but those that
    land an overlapped step with prompt chunks (they wait for its prefill): those that follow steps of their kind (a
    speculative step one, a plain step two) teach the overhead of their kind, the others only what a switch costs."""
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4, max_prefill_tokens=9)
    counts = random_choices(engine, 2, (PLAIN, 2, 4))
    kinds, observed = [], []  # per step: (plain?, None without decode; prefilled?); per measured step: what it taught
    policy, step, schedule = engine.decoding.policy, engine.step, engine.scheduler.schedule
    # a microsecond a step of any kind at any batch (no CUDA graphs here, so nothing was measured): steps take longer
    policy.costs = StepCosts(draft={q: {4: 1e-6} for q in (2, 4, 16)}, verify={q: {4: 1e-6} for q in (PLAIN, 2, 4, 16)})
    observe, plans = policy.observe_seconds, []

    def recording_schedule(**kwargs):
        plans.append(schedule(**kwargs))
        return plans[-1]

    def recording_step(*args, **kwargs):
        before = counts["plain"], counts["speculative"]
        out = step(*args, **kwargs)
        plain, speculative = counts["plain"] - before[0], counts["speculative"] - before[1]
        kinds.append((True if plain else False if speculative else None, bool(plans.pop().prefill)))
        return out

    def recording_observe(option, batch, seconds):
        overhead, switch_seconds = dict(policy.overhead), dict(policy.switch_seconds)
        steady = policy.steady(option == PLAIN)
        observe(option, batch, seconds)
        observed.append((len(kinds), option, steady, policy.overhead != overhead,
                         policy.switch_seconds != switch_seconds))

    policy.observe_seconds = recording_observe
    engine.step, engine.scheduler.schedule = recording_step, recording_schedule
    params_list = [SamplingParams(max_new_tokens=8 + 5 * i) for i in range(len(MANY_PROMPTS))]
    run_staggered(engine, MANY_PROMPTS, params_list)

    def lands_prompt_chunks(i: int) -> bool:  # the step before: overlapped (plain, or chunks alone), with chunks
        return i > 0 and kinds[i - 1][1] and kinds[i - 1][0] is not False

    assert [index for index, *_ in observed] == [i for i, (kind, prefilled) in enumerate(kinds)
                                                  if kind is not None and not prefilled and not lands_prompt_chunks(i)]
    assert any(kind is not None and not prefilled and lands_prompt_chunks(i)
               for i, (kind, prefilled) in enumerate(kinds))
    for index, option, steady, taught_overhead, taught_switch in observed:
        plain = kinds[index][0]
        before = [kind for kind, _ in kinds[index - (2 if plain else 1):index]]
        assert (option == PLAIN) == plain, (index, option, kinds[index])
        assert steady == (len(before) == (2 if plain else 1) and all(kind == plain for kind in before)), index
        assert not (taught_overhead and taught_switch) and (steady or not taught_overhead), index
    assert sum(steady for _, _, steady, *_ in observed) > 5
    assert any(taught_switch for *_, taught_switch in observed)  # a switch measured whole
    switches = sum(a[0] is not None and b[0] is not None and a[0] != b[0] for a, b in zip(kinds, kinds[1:]))
    assert switches > 5  # the random choices switch often: the rule was exercised
    assert_no_leak(engine)


def test_logprobs_through_plain_steps_and_chains_are_plain_decodings(target_dir, tmp_path):
    """Requests that ask for logprobs run plain steps too (only penalties and grammars keep to speculation): each
    token's logprob and top alternatives are plain decoding's, whichever kind of step committed it."""
    params_list = [SamplingParams(max_new_tokens=8 + 3 * i, logprobs=3) for i in range(len(MANY_PROMPTS))]
    plain = spec_engine(target_dir, None, eos=EOS)
    want = [plain.generate_ids([p], params)[0] for p, params in zip(MANY_PROMPTS, params_list)]
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4, max_prefill_tokens=9)
    counts = random_choices(engine, 1, (PLAIN, 2, 4))
    requests = run_staggered(engine, MANY_PROMPTS, params_list)
    assert counts["plain"] > 5 and counts["speculative"] > 5
    for got, expected in zip(requests, want):
        assert got.output_ids == expected.output_ids
        assert_logprobs_close(got.output_logprobs, expected.output_logprobs)
    assert_no_leak(engine)


def test_plain_steps_under_a_small_pool_preempt_and_still_match(target_dir, tmp_path):
    prompts = [[(7 * i + j) % (VOCAB - 3) + 3 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = plain_outputs(target_dir, prompts, [params] * len(prompts))
    engine = dflash_engine(target_dir, tmp_path, num_kv_pages=24, max_num_seqs=4, tree_nodes=3)
    counts = random_choices(engine, 1, (PLAIN, 2, 4))
    requests = [engine.add_request(p, params) for p in prompts]
    preempted = []
    while engine.has_unfinished_requests:
        preempted += engine.step().preempted
    assert [r.output_ids for r in requests] == want
    assert preempted and counts["plain"] > 0 and counts["speculative"] > 0
    assert_no_leak(engine)


def test_aborting_while_a_plain_step_is_in_flight_leaves_the_others_exact(target_dir, tmp_path):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = MANY_PROMPTS[:4]
    want = plain_outputs(target_dir, prompts, [params] * len(prompts))
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4)
    random_choices(engine, 2, (PLAIN,))
    requests = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.flight is not None  # a plain step's tokens are on their way
    engine.abort(requests[1].request_id)
    random_choices(engine, 3, (PLAIN, 2, 4))
    while engine.has_unfinished_requests:
        engine.step()
    kept = [0, 2, 3]
    assert [requests[i].output_ids for i in kept] == [want[i] for i in kept]
    assert requests[1].finish_reason == "abort" and requests[1].output_ids == want[1][:len(requests[1].output_ids)]
    assert_no_leak(engine)


def test_sampled_requests_through_plain_steps_end_clean(target_dir, tmp_path):
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4)
    counts = random_choices(engine, 4, (PLAIN, 2, 4))
    requests = engine.generate_ids(MANY_PROMPTS[:6], SamplingParams(max_new_tokens=16, temperature=0.8, seed=5))
    assert all(r.finished and 1 <= len(r.output_ids) <= 16 for r in requests)
    assert counts["plain"] > 0
    assert_no_leak(engine)


def test_auto_weighs_a_plain_step_where_the_engine_can_overlap_it():
    assert verify_lengths(16, "auto", plain_steps=True) == (PLAIN, 2, 4, 6, 8, 16)
    assert verify_lengths(16, "chain", plain_steps=True) == (16,)
    # a compute-bound batch: the anchor and one draft cost 1.8x the anchor alone and commit 1.86 tokens
    policy = VerifyPolicy(16, (PLAIN, 2, 16), StepCosts(draft={2: {64: 0.4, 256: 1.6}},
                                                         verify={PLAIN: {64: 2.0, 256: 3.0}, 2: {64: 2.2, 256: 5.4},
                                                                 16: {64: 3.5, 256: 40.0}}))
    policy.accepted[0], policy.seen[0] = 0.86, 1.0
    assert policy.choose(256) == PLAIN  # 1 / 3.0 against 1.86 / 7.0
    assert policy.choose(256, plain=False) == 2
    assert policy.choose(64) != PLAIN  # 1.86 / 2.6 against 1 / 2.0


def test_an_engine_without_drafting_ahead_never_runs_plain_steps(target_dir, tmp_path):
    engine = dflash_engine(target_dir, tmp_path, overlap_steps=False)
    assert PLAIN not in engine.decoding.policy.lengths


@pytest.mark.parametrize("plain_at", [range(1, 10), range(4, 9)], ids=["after-prefill", "after-chains"])
def test_after_plain_steps_the_drafter_drafts_from_the_context_a_prefill_writes(target_dir, tmp_path, plain_at):
    """The context rows plain steps add (and those a chain step left to its next draft, written before the first
    plain step) are the target's features at those positions: the first speculative step after them drafts as an
    engine whose prompt was the whole text so far does."""
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    prompt = MANY_PROMPTS[0]
    after_plain, tokens, pending = first_draft_logits(dflash_engine(target_dir, tmp_path), prompt, params, plain_at)
    assert len(tokens) >= len(plain_at) and pending == (plain_at[0] > 1)
    prefilled, again, _ = first_draft_logits(dflash_engine(target_dir, tmp_path), prompt + tokens[:-1], params)
    assert again == [tokens[-1]]  # the same anchor: the text's greedy next token
    assert (after_plain - prefilled).abs().max().item() < 1e-4


def test_decode_only_speculative_steps_teach_the_policy_their_overhead(target_dir, tmp_path):
    """With costs far below what a CPU step takes, the wall time of decode-only speculative steps gives each rung an
    overhead, which then makes plain steps pay: the engine switches to them, and outputs stay plain decoding's."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = MANY_PROMPTS[:4]
    want = plain_outputs(target_dir, prompts, [params] * len(prompts))
    engine = dflash_engine(target_dir, tmp_path, max_num_seqs=4, tree_nodes=3)
    policy = engine.decoding.policy
    rungs = {1: 1e-6, 2: 1e-6, 4: 1e-6}
    # before any overhead is known the chain pays (4 tokens in 1 us against 1 in 1.5 us); a CPU step takes far longer
    policy.costs = StepCosts(draft={}, verify={PLAIN: dict.fromkeys(rungs, 1.5e-6), 2: dict(rungs), 4: dict(rungs)})
    policy.accepted[:] = policy.seen[:] = 1.0
    launched = []
    launch = engine.decoding.launch
    engine.decoding.launch = lambda *args, **kwargs: (launched.append(1), launch(*args, **kwargs))[1]
    requests = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in requests] == want
    assert policy.overhead and all(seconds > 1e-4 for seconds in policy.overhead.values())
    assert launched  # the learned overhead made plain steps pay
    assert_no_leak(engine)


# (prompts, the step each arrives at): requests joining every other step; a long prompt chunked beside one request
# decoding, so that held steps of equal rows repeat the same tables (one listed per chunk row)
CHUNK_WORKLOADS = {"staggered": (MANY_PROMPTS, [2 * i for i in range(len(MANY_PROMPTS))]),
                   "long-prompt": (MANY_PROMPTS[:1] + [[(7 * j) % (VOCAB - 3) + 3 for j in range(70)]], [0, 2])}


@pytest.mark.parametrize("workload", CHUNK_WORKLOADS)
def test_prompt_chunks_beside_plain_steps_are_held_and_written_as_at_once(target_dir, tmp_path, workload):
    """A plain step's prompt chunks riding along are held with its rows and written with later plain steps' (in one
    write with the same requests' decode rows after them): whenever the held rows are written, every request's
    drafter context equals an engine's that writes each step's rows at once, and outputs stay plain decoding's."""
    prompts, arrivals = CHUNK_WORKLOADS[workload]
    params_list = [SamplingParams(max_new_tokens=8 + 5 * i) for i in range(len(prompts))]
    want = plain_outputs(target_dir, prompts, params_list)
    held, at_once = (dflash_engine(target_dir, tmp_path, max_num_seqs=4, max_prefill_tokens=9) for _ in range(2))
    for engine in (held, at_once):
        random_choices(engine, 5, (PLAIN,) * 5 + (4,))
    write_step_context_at_once(at_once.drafter)
    chunk_writes, write_held = [], held.drafter._write_held

    def recorded_write_held():
        chunk_writes.append(held.drafter.held_chunks)
        write_held()

    held.drafter._write_held = recorded_write_held
    requests, compared = {held: [], at_once: []}, 0
    for step in range(400):
        for engine in (held, at_once):
            requests[engine] += [engine.add_request(prompts[i], params_list[i]) for i, at in enumerate(arrivals)
                                 if at == step]
            engine.step()
        if not held.drafter.held_tables:  # every row written: the two contexts hold the same positions
            for a, b in zip(held.scheduler.running, at_once.scheduler.running, strict=True):
                got, expected = drafter_context(held, a), drafter_context(at_once, b)
                assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(got, expected, strict=True)), step
                compared += 1
        if not held.has_unfinished_requests and step >= max(arrivals):
            break
    assert [r.output_ids for r in requests[held]] == [r.output_ids for r in requests[at_once]] == want
    assert any(chunk_writes) and compared > 3
    assert_no_leak(held)


def test_plain_steps_hold_their_context_rows_and_write_them_together(target_dir, tmp_path, monkeypatch):
    """A plain step's context rows (one per request) are copied aside, not written, until HELD_ROWS are held (then
    one step writes them) or a draft comes (which writes them first). Rows of a request preempted meanwhile are
    dropped, not written into the context it starts again with; outputs stay plain decoding's."""
    monkeypatch.setattr(dflash, "HELD_ROWS", 9)  # two plain steps' rows at batch 4, not three
    prompts = [[(5 * i + j) % (VOCAB - 3) + 3 for j in range(20 + 9 * i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = plain_outputs(target_dir, prompts, [params] * len(prompts))
    engine = dflash_engine(target_dir, tmp_path, num_kv_pages=24, max_num_seqs=4, tree_nodes=3)
    drafter = engine.drafter
    random_choices(engine, 5, (PLAIN, PLAIN, PLAIN, 4))
    writes, write_held = [], drafter._write_held  # (rows held, rows dropped) of each write

    def recorded_write_held():
        held = drafter.held_tables
        live = {id(t): t for t in held if t not in drafter.dropped}  # each table once
        before = {key: t.length for key, t in live.items()}
        rows = sum(t not in drafter.dropped for t in held)
        write_held()
        assert sum(t.length - before[key] for key, t in live.items()) == rows  # one position per row written
        writes.append((len(held), len(held) - rows))

    drafter._write_held = recorded_write_held
    repeated, stage_repeated = [], drafter._stage_repeated  # writes of rows of the same requests at every step

    def recorded_stage_repeated(tables, steps):
        repeated.append(steps)
        return stage_repeated(tables, steps)

    drafter._stage_repeated = recorded_stage_repeated
    requests = [engine.add_request(p, params) for p in prompts]
    preempted = []
    while engine.has_unfinished_requests:
        preempted += engine.step().preempted
    assert [r.output_ids for r in requests] == want
    assert preempted and any(dropped for _, dropped in writes)
    assert repeated and len(repeated) < len(writes)  # both ways of staging the rows ran
    assert max(held for held, _ in writes) <= 9 and sum(held > 4 for held, _ in writes) > 3  # more than a step's
    assert not drafter.held_tables or all(t in drafter.dropped for t in drafter.held_tables)
    assert_no_leak(engine)

"""Verifying ahead (`verify_ahead`): a lone greedy request's step also queues the next step's verify, from the draft
it queued ahead, at the position its own acceptance gives (on the device; on CPU the runner reads it back, which
costs nothing there, and tests/gpu checks the device's page metadata). The next step takes that verify when its
batch is still that request alone; an arrival, a finish or an abort drops it. Either way the outputs and the tokens
committed per step are those of steps verified in order, and no page leaks."""

import random

import pytest
import torch

from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_engine, module_target, run_failing, spec_engine

target_dir = module_target("verify-ahead", seed=31)


def engine_for(target_dir, tmp_path, ahead: bool, **config):
    return dflash_engine(target_dir, tmp_path, overlap_steps=True, verify_ahead=ahead, **config)


def count_blocks(engine) -> dict:
    """How many verifies were queued ahead, and how many of them the next step took."""
    counts = {"queued": 0, "taken": 0}
    decoding = engine.decoding
    verify_ahead, take_ahead = decoding._verify_ahead, decoding._take_ahead

    def queue(*args):
        block = verify_ahead(*args)
        counts["queued"] += block is not None
        return block

    def take(*args):
        block = take_ahead(*args)
        counts["taken"] += block is not None
        return block

    decoding._verify_ahead, decoding._take_ahead = queue, take
    return counts


def scripted_drafts(engine, target_dir) -> None:
    """The DFlash drafter's drafts replaced, as each draft step writes them, by the target's own greedy continuation,
    about 3 in 10 corrupted (by position, so that any two runs draft alike): steps then accept every length (a
    random drafter's are rejected). On CPU a draft's tokens are written before anything reads them."""
    drafter, bs = engine.drafter, engine.drafter.block_size
    plain = spec_engine(target_dir, None, eos=(2, 9))
    continuation = {tuple(p): r.output_ids for p, r in zip(
        MANY_PROMPTS, plain.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=80)))}

    def write(row: int, request, anchor: int) -> None:  # the drafts after the output token at index `anchor`
        following = (continuation[tuple(request.prompt_ids)][anchor + 1:] + [3] * bs)[:bs - 1]
        wrong = [(7 * (anchor + j) + len(request.prompt_ids)) % 10 < 3 for j in range(bs - 1)]
        drafter.drafts_out[row, :bs - 1] = torch.tensor(
            [(t + 1) % VOCAB if bad else t for t, bad in zip(following, wrong)])

    propose_next, step = drafter.propose_next, drafter._step

    def queue(requests, anchors, counts, rows, most, length=None, **options):
        queued = propose_next(requests, anchors, counts, rows, most, length, **options)
        for i, request in enumerate(requests if queued else ()):
            if int(counts[i]):  # the step commits counts[i] tokens: its last one is the next anchor
                write(i, request, len(request.output_ids) - 1 + int(counts[i]))
        return queued

    def draft(requests, eager, *args, **kwargs):
        logits = step(requests, eager, *args, **kwargs)
        for i, request in enumerate(requests):
            write(i, request, len(request.output_ids) - 1)
        return logits

    drafter.propose_next, drafter._step = queue, draft


def one_at_a_time(engine, params) -> list:
    return [engine.generate_ids([prompt], params)[0] for prompt in MANY_PROMPTS]


def test_a_lone_request_verified_ahead_commits_what_steps_verified_in_order_commit(target_dir, tmp_path):
    """Each prompt alone, to EOS or the token limit: the same outputs and tokens per step, and all but each
    request's last queued verify taken."""
    params = SamplingParams(max_new_tokens=30)
    engines = [engine_for(target_dir, tmp_path, ahead) for ahead in (False, True)]
    for engine in engines:
        scripted_drafts(engine, target_dir)
    in_order, engine = one_at_a_time(engines[0], params), engines[1]
    counts = count_blocks(engine)
    ahead = one_at_a_time(engine, params)
    assert [r.output_ids for r in ahead] == [r.output_ids for r in in_order]
    assert [r.finish_reason for r in ahead] == [r.finish_reason for r in in_order]
    assert [r.stats.acceptance_lengths for r in ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert counts["taken"] > 20 and counts["queued"] - counts["taken"] <= len(MANY_PROMPTS)
    assert set(x for r in ahead for x in r.stats.acceptance_lengths) == {1, 2, 3, 4}
    assert engine.decoding.ahead is None or engine.decoding.ahead.request_ids == [ahead[-1].request_id]
    assert_no_leak(engine)


def run_with_arrivals(engine) -> tuple[list, int]:
    """A long request decoding alone, short ones added at every sixth step (each ending soon): the requests and
    how many requests the steps preempted."""
    long = engine.add_request(MANY_PROMPTS[2], SamplingParams(max_new_tokens=60, ignore_eos=True))
    requests, preempted, step = [long], 0, 0
    shorts = iter(MANY_PROMPTS[3:])
    while engine.has_unfinished_requests:
        if step % 6 == 5 and (prompt := next(shorts, None)) is not None:
            requests.append(engine.add_request(prompt, SamplingParams(max_new_tokens=3)))
        preempted += len(engine.step().preempted)
        step += 1
    return requests, preempted


@pytest.mark.parametrize("pages", [512, 20])
def test_arrivals_and_finishes_drop_a_verify_queued_ahead(target_dir, tmp_path, pages):
    """Short requests joining a long one that decodes alone, and leaving: the verify queued ahead for the lone
    request is dropped when the next step's batch differs; with a pool that holds the long request alone, the
    others wait (no verify is queued ahead while one waits). Outputs and tokens per step stay those of steps
    verified in order."""
    runs = []
    for ahead in (True, False):
        engine = engine_for(target_dir, tmp_path, ahead, max_num_seqs=4, num_kv_pages=pages)
        scripted_drafts(engine, target_dir)
        counts = count_blocks(engine)
        runs.append(run_with_arrivals(engine))
        assert_no_leak(engine)
        if ahead:
            assert counts["taken"] > 5 and counts["queued"] - counts["taken"] >= 3  # dropped: arrivals
    (with_ahead, preempted), (in_order, _) = runs
    assert [r.output_ids for r in with_ahead] == [r.output_ids for r in in_order]
    assert [r.stats.acceptance_lengths for r in with_ahead] == [r.stats.acceptance_lengths for r in in_order]
    assert not preempted  # a lone request always has its pages: admission reserved them


def test_requests_that_sample_or_adjust_logits_are_never_verified_ahead(target_dir, tmp_path):
    engine = engine_for(target_dir, tmp_path, True)
    counts = count_blocks(engine)
    for params in (SamplingParams(max_new_tokens=20, temperature=0.8, seed=1),
                   SamplingParams(max_new_tokens=20, repetition_penalty=1.3),
                   SamplingParams(max_new_tokens=20, logprobs=2)):
        engine.generate_ids(MANY_PROMPTS[:1], params)
    assert counts["queued"] == 0
    assert_no_leak(engine)


@pytest.mark.parametrize("point", ["_verify_ahead", "_take_ahead"])
def test_an_exception_around_a_verify_ahead_leaves_the_engine_clean(target_dir, tmp_path, point):
    """A verify queued ahead whose queueing or taking fails: every request of the call ends, no page leaks, and the
    engine then gives what a fresh one gives."""
    params = SamplingParams(max_new_tokens=12)
    engine = engine_for(target_dir, tmp_path, True, num_kv_pages=64)
    fresh = [r.output_ids for r in engine_for(target_dir, tmp_path, False).generate_ids(MANY_PROMPTS[:1], params)]
    rng = random.Random(point)
    for _ in range(3):
        run_failing(engine, engine.decoding, point, rng.randint(2, 6), MANY_PROMPTS[:1], params)
    assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:1], params)] == fresh


def test_chains_of_every_length_the_policy_picks_are_verified_ahead_exactly(target_dir, tmp_path):
    """auto picking chains of 2 or 4 tokens at random (and a token tree now and then): a verify queued ahead
    verifies the chain its queued draft was made for, and outputs are those of plain decoding."""
    from specdec.engine.verify_policy import TREE

    params = SamplingParams(max_new_tokens=30)
    plain = [r.output_ids for r in one_at_a_time(spec_engine(target_dir, None, eos=(2, 9)), params)]
    engine = engine_for(target_dir, tmp_path, True, verify="auto")
    scripted_drafts(engine, target_dir)
    counts = count_blocks(engine)
    rng = random.Random(3)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True: rng.choice(
        [2, 4, TREE] if trees else [2, 4])
    verified = []
    ahead = one_at_a_time(engine, params)
    for request in ahead:
        verified += request.stats.verify_lengths
    assert [r.output_ids for r in ahead] == plain
    assert counts["taken"] > 10 and {2, 4} <= set(verified)
    assert_no_leak(engine)

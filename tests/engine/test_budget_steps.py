"""Budget steps (auto): each request verifies its share of the step's rows, by its drafts' confidence. Outputs stay
those of plain decoding, with drafts queued ahead or not, among chain steps, and sampling stays lossless."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import Budget
from tests.engine_helpers import (MANY_PROMPTS, assert_no_leak, budget_step_against_chain, dflash_drafter, module_target,
                                  run_failing, run_workload, spec_engine, tiny_engine)
from tests.sampling_helpers import SAMPLES, outcomes, p_value, sampling, small_vocab_target  # noqa: F401

target_dir = module_target("budget-steps", seed=7)
BUDGET = Budget(8, 4)


def budget_engine(path, tmp_path, options, seed=0, **config):
    """An auto engine over a random block-8 DFlash drafter whose policy picks among `options` at random (budget steps
    at every batch but 1, where auto verifies the whole chain)."""
    engine = spec_engine(path, dflash_drafter(path, tmp_path, 8, seed=3), eos=(2, 9), verify="auto", budget_steps=True,
                         **config)
    assert engine.decoding.policy.budgets == (Budget(4, 2), BUDGET)
    rng = random.Random(seed)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: (
        8 if batch == 1 else rng.choice([o for o in options if budgets or not isinstance(o, Budget)] or [8]))
    return engine


def test_budget_steps_are_asked_for(target_dir, tmp_path):
    """Off by default; on, only under auto (chain and tree steps never share rows out)."""
    drafter = dflash_drafter(target_dir, tmp_path, 8, seed=3)
    assert spec_engine(target_dir, drafter, verify="auto").decoding.policy.budgets == ()
    assert spec_engine(target_dir, drafter, verify="chain", budget_steps=True).decoding.policy.budgets == ()
    assert spec_engine(target_dir, drafter, verify="auto", budget_steps=True).decoding.policy.budgets == (
        Budget(4, 2), BUDGET)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("options", [[BUDGET], [BUDGET, 8, 2]])
def test_budget_steps_equal_autoregressive_decoding(target_dir, tmp_path, ahead, options):
    params = SamplingParams(max_new_tokens=27)
    want = [r.output_ids for r in tiny_engine(target_dir, eos=(2, 9)).generate_ids(MANY_PROMPTS, params)]
    engine = budget_engine(target_dir, tmp_path, options, overlap_steps=ahead, max_num_seqs=5)
    got = engine.generate_ids(MANY_PROMPTS, params)
    assert [r.output_ids for r in got] == want
    assert_no_leak(engine)


def test_each_request_verifies_its_share_of_the_rows(target_dir, tmp_path):
    """A budget step's requests verify different counts (their stats say which), B * per in all."""
    engine = budget_engine(target_dir, tmp_path, [BUDGET], max_num_seqs=8)
    shares = []
    step = engine.decoding.step

    def recording(running, prefill=None):
        tokens = step(running, prefill)
        if engine.decoding.request_lengths is not None:
            shares.append(engine.decoding.request_lengths)
        return tokens

    engine.decoding.step = recording
    requests = engine.generate_ids(MANY_PROMPTS, SamplingParams(max_new_tokens=20))
    assert shares and all(sum(s) == BUDGET.per * len(s) and 1 <= min(s) and max(s) <= BUDGET.q for s in shares)
    assert any(len(set(s)) > 1 for s in shares)
    steps = [q for r in requests for q in r.stats.verify_lengths]
    assert len(set(steps)) > 1 and all(1 <= q <= BUDGET.q for q in steps)


def test_budget_steps_under_a_small_pool_with_arrivals_and_an_abort_stay_exact(target_dir, tmp_path):
    """Requests arrive while others decode (their chunked prompts ride chain steps), a small pool preempts, and one
    request is aborted after budget steps: the others' outputs are plain decoding's and no page stays held."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [[(7 * i + j) % 60 + 3 for j in range(10 + 5 * i)] for i in range(5)]
    want = [r.output_ids for r in tiny_engine(target_dir, eos=(2, 9)).generate_ids(prompts, params)]
    engine = budget_engine(target_dir, tmp_path, [BUDGET, Budget(4, 2), 8], num_kv_pages=64, max_num_seqs=4,
                           overlap_steps=False, max_prefill_tokens=9)
    budget_steps, preempted = [], []
    step = engine.decoding.step

    def recording(running, prefill=None):
        tokens = step(running, prefill)
        budget_steps.append(engine.decoding.request_lengths is not None)
        return tokens

    engine.decoding.step = recording
    requests = [engine.add_request(prompts[0], params)]
    for prompt in prompts[1:]:
        requests.append(engine.add_request(prompt, params))
        preempted += engine.step().preempted
    for _ in range(100):  # until budget steps have run and the pool has preempted: then the first request with output
        if preempted and sum(budget_steps) >= 2:  # but unfinished is aborted
            break
        preempted += engine.step().preempted
    aborted = next(i for i, r in enumerate(requests) if r.output_ids and not r.finished)
    committed = list(requests[aborted].output_ids)
    engine.abort(requests[aborted].request_id)
    for _ in range(300):
        if not engine.has_unfinished_requests:
            break
        preempted += engine.step().preempted
    kept = [i for i in range(len(prompts)) if i != aborted]
    assert [requests[i].output_ids for i in kept] == [want[i] for i in kept]
    assert requests[aborted].output_ids == committed == want[aborted][:len(committed)]
    assert preempted and sum(budget_steps) > 3
    assert_no_leak(engine)


@pytest.mark.parametrize("name", ["run_budget", "propose"])
def test_an_interrupted_budget_step_leaves_the_engine_clean(target_dir, tmp_path, name):
    """An interrupt in a budget step's verify or in its draft ends the call's requests with what they committed;
    the engine then generates as before."""
    params = SamplingParams(max_new_tokens=20)
    engine = budget_engine(target_dir, tmp_path, [BUDGET], max_num_seqs=4)
    want = [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:3], params)]
    owner = engine.runner if name == "run_budget" else engine.drafter
    assert run_failing(engine, owner, name, 3, MANY_PROMPTS, params)
    assert [r.output_ids for r in engine.generate_ids(MANY_PROMPTS[:3], params)] == want
    assert_no_leak(engine)


def test_budget_sampling_matches_autoregressive(small_vocab_target, tmp_path):  # noqa: F811
    """A request's rows past its share are never accepted: sampled outputs keep plain decoding's distribution."""
    engine = spec_engine(small_vocab_target, dflash_drafter(small_vocab_target, tmp_path, 8), verify="auto",
                         budget_steps=True, max_num_seqs=SAMPLES)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: (
        BUDGET if budgets and batch > 1 else 8)
    budget = outcomes(engine, sampling(1.0, 5 * 10 ** 6))
    auto = outcomes(tiny_engine(small_vocab_target, eos=(), max_num_seqs=SAMPLES), sampling(1.0, 6 * 10 ** 6))
    assert p_value(budget, auto) > 1e-3
    assert engine.pool.num_free == engine.pool.num_pages


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_a_budget_steps_rows_are_the_chain_steps_rows(target_dir, tmp_path, batch):
    """run_budget against run_block over the same tokens and context: each verified row's logits, argmax and features
    are the chain's, laid out as the chain's (logits asked for, as sampling does); the rows not run have argmax -1."""
    engine = budget_engine(target_dir, tmp_path, [BUDGET])
    prompts = MANY_PROMPTS[:batch]
    (chain_logits, chain_greedy, chain_features), (logits, greedy, features), lengths = budget_step_against_chain(
        engine, prompts, BUDGET.q, BUDGET.per)
    assert sum(lengths) == BUDGET.per * batch and all(1 <= n <= BUDGET.q for n in lengths)
    run = torch.tensor([i * BUDGET.q + j for i, n in enumerate(lengths) for j in range(n)])
    skipped = torch.tensor([r for r in range(batch * BUDGET.q) if r not in set(run.tolist())], dtype=torch.long)
    torch.testing.assert_close(logits[run], chain_logits[run], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(features[run], chain_features[run], atol=1e-5, rtol=1e-5)
    assert torch.equal(greedy[run], chain_greedy[run]) and (greedy[skipped] == -1).all()
    assert_no_leak(engine)


SHARED = [[(7 * i + 3) % 60 + 5 for i in range(22)], [70, 71, 72, 73, 74, 75, 76]]  # prefixes the cache may hold


@st.composite
def workloads(draw):
    """Arrivals (a shared prefix + own tokens, arrival step, max new tokens), aborts (request, step), pool size,
    prefill budget, drafts queued ahead or not, the policy's seed."""
    arrivals = draw(st.lists(st.tuples(st.sampled_from(range(len(SHARED))), st.lists(st.integers(5, 60), max_size=6),
                                       st.integers(0, 6), st.integers(1, 16)), min_size=2, max_size=6))
    aborts = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12)), max_size=2))
    return (arrivals, aborts, draw(st.sampled_from([40, 64, 300])), draw(st.sampled_from([6, 64])),
            draw(st.booleans()), draw(st.integers(0, 99)))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_random_workloads_of_budget_steps_end_exact_with_every_page_free_or_cached(target_dir, tmp_path, workload):
    """Budget steps among chains in random workloads: arrivals sharing cached prefixes, aborts, small pools that
    preempt, chunked prompts, drafts queued ahead or not. Every page ends free or cached, and each answer that ran
    to its length is the one plain decoding gives."""
    arrivals, aborts, num_pages, prefill_budget, ahead, seed = workload
    engine = budget_engine(target_dir, tmp_path, [BUDGET, Budget(4, 2), 8, 2], seed=seed, num_kv_pages=num_pages,
                           max_num_seqs=4, max_prefill_tokens=prefill_budget, overlap_steps=ahead)
    requests = run_workload(engine, [(at, lambda base=base, own=own, max_new=max_new: [engine.add_request(
        SHARED[base] + own, SamplingParams(max_new_tokens=max_new, ignore_eos=True))])
        for base, own, at, max_new in arrivals], aborts)
    assert_no_leak(engine)
    reference = tiny_engine(target_dir, eos=(2, 9), enable_prefix_caching=False)
    for request in (r for r in requests if r.finish_reason == "length"):
        assert request.output_ids == reference.generate_ids([request.prompt_ids], request.params)[0].output_ids

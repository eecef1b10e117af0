"""Verifying part of the chain: the policy's choice, and steps that verify fewer drafts staying exact."""

import numpy as np
import pytest

from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import CHAIN_MARGIN, PRIOR_SEEN, TREE, StepCosts, VerifyPolicy, verify_lengths
from tests.conftest import build_tiny_model
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, spec_engine, tiny_engine


def test_the_lengths_a_policy_chooses_from():
    assert verify_lengths(16, "chain") == (16,)
    assert verify_lengths(16, "auto") == (2, 4, 6, 8, 16)
    assert verify_lengths(4, "auto") == (2, 4)
    assert verify_lengths(2, "auto") == (2,)
    with pytest.raises(ValueError, match="include 16"):
        VerifyPolicy(16, (4, 8))


def test_acceptance_is_counted_only_where_it_was_seen():
    policy = VerifyPolicy(8, (2, 4, 8))
    policy.observe([3, 1, 0], q=4)  # 3 drafts verified each: all accepted, one accepted, none
    seen = policy.seen - PRIOR_SEEN * 0.995
    accepted = policy.accepted - 0.995
    assert np.allclose(seen, [3, 2, 1, 0, 0, 0, 0]) and np.allclose(accepted, [2, 1, 1, 0, 0, 0, 0])


def test_expected_tokens_follow_the_per_position_rates():
    policy = VerifyPolicy(4, (2, 4))
    policy.accepted[:], policy.seen[:] = [8, 5, 1], [10, 10, 10]  # 0.8, then 0.5, then 0.1
    assert np.allclose(policy.expected_tokens(), [1, 1.8, 1.8 + 0.4, 1.8 + 0.4 + 0.04])


def test_the_whole_chain_where_verifying_more_costs_little_and_a_short_one_where_it_costs_much():
    costs = StepCosts(draft=dict.fromkeys((4, 8, 16), {1: 1e-3, 64: 2e-3}),
                      verify={4: {1: 2.0e-3, 64: 4e-3}, 8: {1: 2.0e-3, 64: 7e-3}, 16: {1: 2.0e-3, 64: 9e-3}})
    policy = VerifyPolicy(16, (4, 8, 16), costs)
    rates = np.array([0.86, 0.81, 0.79, 0.76, 0.69, 0.61, 0.5, 0.5, 0.5, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3])
    policy.accepted[:], policy.seen[:] = rates * 100, 100
    assert policy.choose(1) == 16  # the chain costs what a short verify does
    assert policy.choose(40) == 4  # rung 64: 3.1 tokens in 6 ms, against 4.1 in 9 ms and 4.3 in 11 ms
    assert policy.choose(65) == 16  # above the measured ladder: the whole chain
    assert VerifyPolicy(16, (4, 8, 16)).choose(40) == 16  # nothing measured (no graphs): the whole chain


def test_a_shorter_chain_only_where_it_pays_by_more_than_the_costs_tell_apart():
    """The start-up costs at batch 1 of an H200 (a random-weight target of the default's shape), here for two
    requests, and math500's per-position acceptance: the chain of 8 comes out 1% ahead of the whole chain by its
    costs, within the margin, so the whole chain runs; a shorter chain that pays by more runs."""
    costs = StepCosts(draft={8: {2: 0.432e-3}, 16: {2: 0.435e-3}}, verify={8: {2: 2.047e-3}, 16: {2: 2.152e-3}})
    policy = VerifyPolicy(16, (8, 16), costs)
    rates = np.array([0.86, 0.81, 0.79, 0.76, 0.74, 0.61, 0.58, 0.5, 0.5, 0.67, 0.5, 0, 0, 0, 0])
    policy.accepted[:], policy.seen[:] = rates * 100, 100
    expected = policy.expected_tokens()
    rate = {q: expected[q - 1] / costs.at(2)[q] for q in (8, 16)}
    assert 1 < rate[8] / rate[16] < 1 + CHAIN_MARGIN
    assert policy.choose(2) == 16
    policy.costs = StepCosts(draft=costs.draft, verify={8: {2: 2.047e-3}, 16: {2: 2.4e-3}})
    assert policy.choose(2) == 8


def test_a_lone_request_verifies_the_whole_chain_whatever_the_other_options_would_cost():
    """At batch 1 every chain length streams the weights once (an H200's steps: 3.04 ms for 16, 3.11 for 8), only the
    whole chain keeps plain decoding's bits, and a tree step's host work makes it slower than its cost says: costs
    that favor a chain of 8, a plain step or a tree by far do not make them run. With two requests they do; with
    trees only, a lone request's steps are trees."""
    from specdec.engine.verify_policy import PLAIN

    costs = StepCosts(draft={2: {1: 0.4e-3, 2: 0.4e-3}, 8: {1: 0.4e-3, 2: 0.4e-3}, 16: {1: 0.4e-3, 2: 0.4e-3}},
                      verify={PLAIN: {1: 2.0e-3, 2: 2.0e-3}, 2: {1: 2.0e-3, 2: 2.0e-3}, 8: {1: 2.0e-3, 2: 2.0e-3},
                              16: {1: 4.0e-3, 2: 4.0e-3}, TREE: {1: 2.2e-3, 2: 2.2e-3}})
    rates = np.array([0.86, 0.81, 0.79, 0.76, 0.74, 0.61, 0.58, 0.5, 0.1, 0.1, 0.1, 0, 0, 0, 0])
    policy = VerifyPolicy(16, (PLAIN, 2, 8, 16), costs)
    policy.accepted[:], policy.seen[:] = rates * 100, 100
    assert policy.choose(2) == 8  # two requests: 8 costs half of 16 and commits nearly as much
    assert policy.choose(1) == 16
    rejecting = VerifyPolicy(16, (PLAIN, 2, 8, 16), costs)
    rejecting.accepted[:], rejecting.seen[:] = 2, 100  # drafts almost never accepted
    assert rejecting.choose(2) == PLAIN and rejecting.choose(1) == 16
    trees = VerifyPolicy(16, (2, 8, 16), costs, tree=True)
    trees.accepted[:], trees.seen[:] = rates * 100, 100
    assert trees.choose(2, tree_nodes=63) == TREE and trees.choose(1, tree_nodes=63) == 16
    assert VerifyPolicy(16, (), costs, tree=True).choose(1, tree_nodes=63) == TREE


def test_each_option_counts_its_own_draft_step():
    """A chain's draft step scores only the drafts it verifies: where scoring all 15 costs 3x scoring 3, the short
    chain's cheaper draft decides; with one draft cost for all, the whole chain wins."""
    verify = {4: {64: 4e-3}, 16: {64: 4.2e-3}}
    policy = VerifyPolicy(16, (4, 16), StepCosts(draft={4: {64: 1e-3}, 16: {64: 3e-3}}, verify=verify))
    rates = np.array([0.86, 0.70, 0.55, 0.42, 0.29, 0.18, 0.11, 0.06, 0.03, 0.01, 0.01, 0, 0, 0, 0])
    policy.accepted[:], policy.seen[:] = rates * 100, 100
    assert policy.costs.at(64) == pytest.approx({4: 5e-3, 16: 7.2e-3})
    assert policy.choose(64) == 4  # 2.79 tokens in 5 ms against 2.98 in 7.2 ms
    policy.costs = StepCosts(draft=dict.fromkeys((4, 16), {64: 1e-3}), verify=verify)
    assert policy.choose(64) == 16  # 2.79 tokens in 5 ms against 2.98 in 5.2 ms


def test_trees_where_they_pay_and_only_where_they_are_measured():
    """A tree costs more than the chain but accepts more: chosen for two requests, not for 8 where its cost
    grows; above its measured rungs it is never chosen. Before any tree step its expected tokens are
    the chain's times a gain for its size; then its own running mean."""
    costs = StepCosts(draft=dict.fromkeys((4, 16, TREE), {2: 1e-3, 8: 1e-3, 64: 2e-3}),
                      verify={4: {2: 2e-3, 8: 2e-3, 64: 4e-3}, 16: {2: 2e-3, 8: 3e-3, 64: 9e-3},
                              TREE: {2: 2.2e-3, 8: 9e-3}})
    policy = VerifyPolicy(16, (4, 16), costs, tree=True)
    rates = np.array([0.86, 0.70, 0.55, 0.42, 0.29, 0.18, 0.11, 0.06, 0.03, 0.01, 0.01, 0, 0, 0, 0])
    policy.accepted[:], policy.seen[:] = rates * 100, 100
    chain = policy.expected_tokens()[-1]
    assert policy.expected_tree_tokens(63) == pytest.approx(chain * 1.3)  # 63 nodes: +30% before any tree step
    assert policy.choose(2, tree_nodes=63) == TREE
    assert policy.choose(8, tree_nodes=63) != TREE
    assert policy.choose(40, tree_nodes=15) == 4  # no tree measured at rung 64
    for _ in range(50):  # trees turn out no better than the chain: the chain again
        policy.observe_tree([round(chain) - 1] * 3, 63)
    assert policy.choose(2, tree_nodes=63) == 16


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify-policy")
    build_tiny_model("qwen3", path, seed=5)
    return path


def lengths_by_batch(engine, short_from: int, trees_below: int = 0):
    """Costs that make a step of `short_from` or more requests verify 2 tokens, smaller ones the block (4),
    and one of fewer than `trees_below` requests a token tree; returns what the steps then chose (TREE = 0)."""
    policy = engine.decoding.policy
    rungs = sorted({1, 2, 3, short_from - 1, short_from, trees_below - 1, trees_below, 64} - {0, -1})
    policy.costs = StepCosts(draft={}, verify={
        2: {r: 1.0 for r in rungs},
        4: {r: 1.0 if r < short_from else 100.0 for r in rungs},
        TREE: {r: 1e-3 if r < trees_below else 1e3 for r in rungs}})
    chosen, choose = [], policy.choose

    def recording(batch, nodes=0, trees=True, plain=True, budgets=True):
        chosen.append(choose(batch, nodes, trees, plain, budgets))
        return chosen[-1]

    policy.choose = recording
    return chosen


def test_steps_mixing_trees_and_chains_equal_autoregressive_decoding(target_dir, tmp_path):
    prompts = MANY_PROMPTS[:6]
    params = SamplingParams(max_new_tokens=29)
    want = [r.output_ids for r in tiny_engine(target_dir, eos=()).generate_ids(prompts, params)]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), verify="auto", max_num_seqs=4,
                         tree_nodes=10)
    chosen = lengths_by_batch(engine, short_from=4, trees_below=3)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == want
    assert {2, TREE} <= set(chosen)  # chains at 4 requests, trees at the tail of 2 and 1
    assert max(q for r in got for q in r.stats.verify_lengths) > 4  # trees larger than the block ran
    assert_no_leak(engine)


def test_steps_verifying_fewer_drafts_equal_autoregressive_decoding(target_dir, tmp_path):
    prompts = MANY_PROMPTS[:6]
    params = SamplingParams(max_new_tokens=29)
    want = [r.output_ids for r in tiny_engine(target_dir, eos=()).generate_ids(prompts, params)]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), verify="auto", max_num_seqs=4)
    chosen = lengths_by_batch(engine, short_from=3)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == want
    assert {2, 4} <= set(chosen)  # both lengths ran (batches of 4, then the tail of 2 and 1)
    assert_no_leak(engine)


def test_the_drafter_reads_each_requests_features_after_a_short_verify(target_dir, tmp_path):
    """Request i's verify features start at row i * q: after a step verifying 2 tokens per request, a
    request that committed what it would have with the whole block gets the same first draft (its drafter
    context holds the same positions' features), whatever its row in the batch."""
    prompts = MANY_PROMPTS[:3]
    drafts = {}
    for name, short_from in (("block", 64), ("short", 1)):
        engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), verify="auto", max_num_seqs=4)
        lengths_by_batch(engine, short_from)
        proposals, propose = [], engine.drafter.propose

        def recording(requests, n=None, p=proposals, f=propose):
            p.append(f(requests, n)[:, :n].clone())  # the drafts the step verifies
            return p[-1]

        engine.drafter.propose = recording
        requests = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        while len(proposals) < 2:
            engine.step()
        drafts[name] = (proposals[1], [len(r.output_ids) for r in requests])
    (block, counts_block), (short, counts_short) = drafts["block"], drafts["short"]
    # requests that committed as many tokens in both runs (the same ones: greedy) have the same context
    same = [i for i in range(3) if counts_block[i] == counts_short[i]]
    assert len(same) >= 2, (counts_block, counts_short)
    assert short.shape[1] == 1 and block.shape[1] == 3  # a step scores only the drafts it verifies
    for i in same:  # the first draft, scored by both
        assert block[i, :1].tolist() == short[i].tolist(), i


def test_what_each_kind_of_step_takes_beyond_its_measured_cost_is_learned_from_its_wall_time():
    """Decode-only steps that take longer than their measured cost teach the policy their rung's overhead, one per
    kind: the best speculative option carries the speculative steps', a plain step the plain steps'."""
    from specdec.engine.verify_policy import PLAIN

    costs = StepCosts(draft={2: {64: 0.5, 256: 1.0}}, verify={PLAIN: {64: 2.0, 256: 3.0}, 2: {64: 2.2, 256: 4.0},
                                                              16: {64: 3.5, 256: 30.0}})
    policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
    policy.accepted[0], policy.seen[0] = 0.86, 1.0
    assert policy.choose(200) == 2  # 1.86 / 5.0 against 1 / 3.0, with no overhead known
    for _ in range(30):
        policy.observe_seconds(2, 200, 7.0)  # 2 s beyond the measured 5 s
    assert policy.overhead == {(256, False): pytest.approx(2.0, rel=0.01)}
    assert policy.overheads_at(200) == (pytest.approx(2.0, rel=0.01), 0.0)
    assert policy.choose(200) == PLAIN  # 1.86 / 7.0 < 1 / 3.0
    # another rung, where nothing is learned yet, takes the nearest rung's estimate: 2.72 / (3.5 + 2.0) < 1 / 2.0
    assert policy.overheads_at(40) == (pytest.approx(2.0, rel=0.01), 0.0)
    assert policy.choose(40) == PLAIN
    for _ in range(30):  # its own steps refine it from there: 0.2 s beyond the measured 3.5
        policy.observe_seconds(16, 40, 3.7)
    assert policy.overhead[64, False] == pytest.approx(0.2 + 1.8 * 0.9 ** 30, rel=0.01)
    assert policy.choose(40) == 16  # 2.72 / 3.77 > 1 / 2.0
    assert policy.overhead[256, False] == pytest.approx(2.0, rel=0.01)  # the other rung's estimate is its own
    policy.observe_seconds(2, 300, 9.0)  # above the measured ladder: nothing to compare with
    assert set(policy.overhead) == {(64, False), (256, False)}
    for _ in range(30):
        policy.observe_seconds(PLAIN, 200, 4.0)  # plain steps take 1 s beyond their measured 3 s
    assert policy.overhead[256, True] == pytest.approx(1.0, rel=0.01)
    assert policy.choose(200) == 2  # 1 / 4.0 < 1.86 / (5.0 + the faded 2 * 0.99 ** 30)


def test_a_slow_step_among_steady_ones_counts_at_most_twice_their_median_until_a_change_lasts():
    """Plain steps that take 0.3 ms beyond their measured 3 ms, then one of 8.6 ms (as on an H200 at 256 coding
    requests): it counts as 0.6 ms, and plain steps stay ahead of chains of 2 (1.8 tokens in 5 ms and a faded 1.2 ms of
    overhead); counted whole it would put plain steps' estimate at 0.83 ms and set off a try of speculation. A change
    that lasts is counted whole once it shows in the median of the last 16 steps, after 8."""
    from specdec.engine.verify_policy import PLAIN

    costs = StepCosts(draft={2: {256: 1.0e-3}}, verify={PLAIN: {256: 3.0e-3}, 2: {256: 4.0e-3}})
    policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
    policy.accepted[0], policy.seen[0] = 0.8, 1.0
    policy.overhead = {(256, False): 1.5e-3}

    def plain_steps(count: int, seconds: float) -> None:
        for _ in range(count):
            policy.ran(True, 250)
            policy.observe_seconds(PLAIN, 250, seconds)

    plain_steps(18, 3.3e-3)
    assert policy.overhead[256, True] == pytest.approx(0.3e-3)
    plain_steps(1, 8.6e-3)
    assert policy.overhead[256, True] == pytest.approx(0.9 * 0.3e-3 + 0.1 * 0.6e-3)
    assert policy.choose(250) == PLAIN
    plain_steps(7, 5.0e-3)  # a lasting change: 2 ms beyond the cost, counted as 0.6 while the median is 0.3
    assert policy.overhead[256, True] < 0.6e-3
    plain_steps(30, 5.0e-3)
    assert policy.overhead[256, True] == pytest.approx(2.0e-3, rel=0.05)


def test_an_estimate_the_running_kind_cannot_refresh_fades_until_the_other_kind_is_tried():
    """Steps of one kind measure nothing of the other: its estimate fades by 1% a step, so the other kind is tried
    again after some dozens of steps, whichever kind an early outlier had ruled out."""
    from specdec.engine.verify_policy import PLAIN

    costs = StepCosts(draft={2: {256: 1.0}}, verify={PLAIN: {256: 3.0}, 2: {256: 4.0}})
    for outlier, running in ((PLAIN, 2), (2, PLAIN)):
        policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
        policy.accepted[0], policy.seen[0] = 0.86, 1.0
        policy.observe_seconds(outlier, 200, 20.0)  # one slow step of the kind not running now
        steps = 0
        while policy.choose(200) == running and steps < 1000:
            policy.observe_seconds(running, 200, costs.at(200)[running] + (1.0 if running == PLAIN else 2.0))
            steps += 1
        assert 20 < steps < 400, (outlier, steps)

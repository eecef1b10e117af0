"""Switching between plain steps and speculation (`auto`): the dwell, which steps teach a kind's overhead, and what a
switch costs, down to simulations with the step times an H200 took."""

import math

import numpy as np
import pytest

import specdec.engine.verify_policy as verify_policy
from specdec.engine.verify_policy import KIND_DWELL, PLAIN, StepCosts, VerifyPolicy


def test_a_kind_switched_to_runs_for_its_dwell_before_the_costs_decide_again():
    """Whichever kind the costs favour, a step of the other kind (e.g. one that had to speculate) is followed by
    KIND_DWELL - 1 more of its kind: switches cost more than steady steps, and alternating kinds lose what either
    delivers alone."""
    costs = StepCosts(draft={2: {256: 1.0}}, verify={PLAIN: {256: 3.0}, 2: {256: 4.0}})
    for favoured, other in ((PLAIN, 2), (2, PLAIN)):
        policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
        policy.accepted[0], policy.seen[0] = (0.5, 1.0) if favoured == PLAIN else (0.95, 1.0)  # 1.5 or 1.95 / 5.0
        assert policy.choose(200) == favoured  # no step yet: the costs decide
        policy.ran(other == PLAIN)
        kinds = []
        for _ in range(2 * KIND_DWELL):
            kinds.append(policy.choose(200))
            policy.ran(kinds[-1] == PLAIN)
        assert kinds == [other] * (KIND_DWELL - 1) + [favoured] * (KIND_DWELL + 1), (favoured, kinds)
        assert policy.choose(200, plain=False) == 2  # a step that must speculate is never held to a plain dwell
        assert policy.choose(1) == 16  # nor a lone request


def test_only_steps_that_follow_their_own_kind_are_steady():
    """The first speculative step after plain ones lands the plain step in flight; the first two plain steps after
    speculative ones wait for what the switch left queued: none of them is a steady step of its kind."""
    policy = VerifyPolicy(16, (1, 2, 16))
    seen = []
    for plain in (True, True, True, True, False, False, False, True, True, True, False):
        policy.ran(plain)
        seen.append(policy.steady(plain))
    assert seen == [False, False, True, True, False, True, True, False, False, True, False]
    assert not policy.steady(True)  # the step running now is speculative


def walled_policy() -> VerifyPolicy:
    """Measured costs of 3 ms (plain) and 5 ms (a chain of 2) at rung 256, and learned overheads that make steady steps
    3.5 and 6.5 ms."""
    policy = VerifyPolicy(16, (PLAIN, 2, 16), StepCosts(draft={2: {256: 1.0}}, verify={PLAIN: {256: 3.0}, 2: {256: 4.0}}))
    policy.overhead = {(256, True): 0.5, (256, False): 1.5}
    return policy


def test_the_steps_of_a_switch_teach_its_cost_and_not_the_overhead_of_their_kind():
    """What the steps before a kind turns steady take beyond its steady steps is the cost of switching to it; the first
    plain step after speculation may take less than a steady one (nothing in flight to wait for), so a switch's steps
    count summed."""
    policy = walled_policy()
    for plain, wall in ((True, 3.5), (True, 3.5), (True, 3.5), (False, 11.5), (False, 6.5), (True, 3.0), (True, 4.5),
                        (True, 3.5)):
        policy.ran(plain)
        policy.observe_seconds(PLAIN if plain else 2, 200, wall)
    # 11.5 - 6.5 into speculation; (3.0 - 3.5) + (4.5 - 3.5) into plain steps (the other kind's overhead fades by 1% a step)
    assert policy.switch_seconds == {False: pytest.approx(5.0, rel=0.01), True: pytest.approx(0.5, rel=0.05)}
    assert policy.switch_cost(False) == pytest.approx(5.0, rel=0.01) and policy.switch_cost(True) == pytest.approx(
        0.5, rel=0.05)
    assert policy.overhead[256, True] == pytest.approx(0.5, rel=0.02)  # only steady steps teach it
    assert policy.overhead[256, False] == pytest.approx(1.5, rel=0.02)


def test_a_switch_with_a_step_unmeasured_teaches_nothing():
    """A step with prompt chunks is not measured (its wall time holds their prefill): a switch it was part of has no
    known cost, and the first steps of all (no kind before them) are no switch."""
    policy = walled_policy()
    for plain, measured in ((True, True), (True, True), (False, True), (False, True), (True, False), (True, True),
                            (True, True)):
        policy.ran(plain)
        if measured:
            policy.observe_seconds(PLAIN if plain else 2, 200, 9.0)
    assert set(policy.switch_seconds) == {False}  # into speculation; into plain steps: one unmeasured


def test_the_kind_not_running_pays_for_switching_to_it_over_its_dwell():
    """Where the kinds deliver about the same, the kind running stays while switching to the other would cost more
    than its gain over a dwell."""
    def running(plain: bool, accepted: float, switch_seconds: dict) -> VerifyPolicy:
        policy = walled_policy()
        policy.accepted[0], policy.seen[0] = accepted, 1.0
        policy.switch_seconds = switch_seconds
        policy.ran(plain)
        policy.kind_steps = KIND_DWELL
        return policy

    learned = {False: 4.0, True: 1.0}  # into speculation 0.5 ms a step of a dwell, into plain steps 0.125
    # 1.9 tokens / 6.5 ms against 1 / 3.5 ms: speculation 2.3% ahead
    assert running(True, 0.9, {}).choose(200) == 2
    assert running(True, 0.9, learned).choose(200) == PLAIN
    # 1.8 / 6.5: speculation 3.1% behind
    assert running(False, 0.8, {}).choose(200) == PLAIN
    assert running(False, 0.8, learned).choose(200) == 2


def simulate(policy: VerifyPolicy, batch: int, option: int, steady_ms: dict, switch_ms: dict, accept: float,
             steps: int, seed: int = 0, slow_plain: float = 0.0) -> tuple[float, int, float]:
    """`steps` steps of `batch` requests under `policy`, with wall times (5% noise) of steady_ms[plain?] for steady steps
    and switch_ms[plain?] for a kind's first steps after a switch, but a `slow_plain` share of the steady plain steps
    taking 4-8.6 ms (as on an H200 at 256 coding requests); a speculative step verifies `option` tokens a request and
    accepts each draft with probability `accept` once the ones before it are. The policy is told each step's kind, wall
    time and acceptance, as the engine tells it. Returns (share of plain steps, switches of kind, committed tokens per
    request per ms)."""
    rng = np.random.default_rng(seed)
    kinds, tokens, ms = [], 0.0, 0.0
    for _ in range(steps):
        q = policy.choose(batch)
        plain = q == PLAIN
        policy.ran(plain, batch)
        after = switch_ms[plain]
        switching = kinds and policy.kind_steps <= len(after)
        wall = after[policy.kind_steps - 1] if switching else steady_ms[plain]
        if slow_plain and plain and not switching and rng.random() < slow_plain:
            wall = rng.uniform(4.0, 8.6)
        wall *= 1 + 0.05 * rng.standard_normal()
        policy.observe_seconds(q, batch, wall / 1e3)
        if plain:
            tokens += 1
        else:
            accepted = np.minimum(rng.geometric(1 - accept, batch) - 1, q - 1)
            policy.observe(accepted.tolist(), q)
            tokens += 1 + accepted.mean()
        kinds.append(plain)
        ms += wall
    return sum(kinds) / steps, sum(a != b for a, b in zip(kinds, kinds[1:])), tokens / ms


def old_rules(monkeypatch) -> None:
    """The rules before the dwell, `steady`, switch costs and the probes' backoff: a kind may switch at any step, the
    second step of a kind is measured as steady, switches cost nothing, and the kind not running fades at one rate."""
    monkeypatch.setattr(verify_policy, "PROBE_BACKOFF_MAX", 0)
    monkeypatch.setattr(verify_policy, "KIND_DWELL", 1)
    monkeypatch.setattr(verify_policy, "STEADY_AFTER", {False: 1, True: 1})
    monkeypatch.setattr(VerifyPolicy, "switch_cost", lambda self, plain: 0.0)


@pytest.mark.parametrize("accept", [0.6, 0.75, 0.9])
def test_switch_costs_do_not_trap_the_policy_in_alternating_kinds(monkeypatch, accept):
    """250 requests with the step times an H200 took on 256 coding requests: steady plain steps 3.5 ms, steady chains
    of 2 7.5; after a switch, the first two plain steps 4.8 and 6.3 and the first speculative one 13.3. Plain steps
    pay more than speculation (1 / 3.5 against at most 1.9 / 7.5 tokens per ms) and the two kinds' measured costs are
    close: the policy keeps mostly to plain steps, trying speculation now and then, and delivers at least 90% of the
    plain steps' rate. With the old rules the same steps alternate kinds for hundreds of steps, as they did on the H200."""
    def policy():
        costs = StepCosts(draft={2: {256: 1.3e-3}}, verify={PLAIN: {256: 3.0e-3}, 2: {256: 4.0e-3}, 16: {256: 40e-3}})
        made = VerifyPolicy(16, (PLAIN, 2, 16), costs)
        made.accepted[0], made.seen[0] = accept, 1.0
        made.overhead = {(256, False): 0.8e-3, (256, True): 0.58e-3}  # learned on steady steps before
        return made

    walls = ({True: 3.5, False: 7.5}, {True: (4.8, 6.3), False: (13.3,)})
    share, switches, rate = simulate(policy(), 250, 2, *walls, accept, 400)
    assert share > 0.6 and switches <= 24 and rate >= 0.9 / 3.5, (share, switches, rate)
    old_rules(monkeypatch)
    share, switches, _ = simulate(policy(), 250, 2, *walls, accept, 400)
    assert share < 0.25 and switches > 30, (share, switches)


@pytest.mark.parametrize("accept", [0.45, 0.5, 0.55])
def test_where_the_kinds_deliver_about_the_same_switches_are_few(monkeypatch, accept):
    """150 requests with the step times an H200 took on the coding requests at that batch: steady plain steps 3.3 ms,
    steady chains of 4 6.4; the first speculative step after plain ones 11.5, the first two plain steps after
    speculation 2.7 and 3.4. The chain delivers 0.92x to 1.07x the plain steps' rate: the policy switches 3-7 times in
    600 steps and delivers 98-99% of the better kind's rate. Charging the kind not running for the switch to it does
    most of that: without the probes' backoff the policy switches 7-18 times and delivers 97-99%, and without the
    charge either 25-61 times, delivering 93-96%."""
    def policy():
        costs = StepCosts(draft={4: {160: 1.0e-3}, 16: {160: 2.5e-3}},
                          verify={PLAIN: {160: 2.8e-3}, 4: {160: 4.0e-3}, 16: {160: 12e-3}})
        return VerifyPolicy(16, (PLAIN, 4, 16), costs)

    walls = ({True: 3.3, False: 6.4}, {True: (2.7, 3.4), False: (11.5,)})
    best = max(1 / 3.3, (1 + accept + accept ** 2 + accept ** 3) / 6.4)

    def run() -> tuple[float, float]:  # mean switches and rate over four seeds
        results = [simulate(policy(), 150, 4, *walls, accept, 600, seed) for seed in range(4)]
        return np.mean([r[1] for r in results]), np.mean([r[2] for r in results])

    switches, rate = run()
    assert switches <= 20 and rate >= 0.965 * best, (switches, rate / best)
    # the charge alone, without the probes' backoff (which also spares switches here)
    monkeypatch.setattr(verify_policy, "PROBE_BACKOFF_MAX", 0)
    switches, rate = run()
    monkeypatch.setattr(VerifyPolicy, "switch_cost", lambda self, plain: 0.0)
    switches_uncharged, rate_uncharged = run()
    assert switches_uncharged > 2 * switches and rate_uncharged < rate, (switches_uncharged, rate_uncharged / best)


def probe_starts(policy: VerifyPolicy, steps: int, accept: float, seed: int = 0) -> list[int]:
    """The steps at which the policy switched to speculation, over `steps` steps of 250 requests with the H200's step
    times of the test above (steady plain steps 3.5 ms, chains of 2 7.5 ms: speculation never pays)."""
    rng = np.random.default_rng(seed)
    starts = []
    for step in range(steps):
        q = policy.choose(250)
        plain = q == PLAIN
        if not plain and policy.plain_running:
            starts.append(step)
        policy.ran(plain, 250)
        first = policy.kind_steps == 1 and step > 0
        wall = (4.8 if plain else 13.3) if first else (3.5 if plain else 7.5)
        policy.observe_seconds(q, 250, wall * (1 + 0.05 * rng.standard_normal()) / 1e3)
        if not plain:
            policy.observe(np.minimum(rng.geometric(1 - accept, 250) - 1, q - 1).tolist(), q)
    return starts


def plain_steps_running(plain_cost: float, overheads: dict) -> VerifyPolicy:
    """A policy running plain steps of 250 requests (rung 256), their measured cost `plain_cost` s against 5.3 ms for a
    chain of 2 (the first draft accepted 90% of the time) and 40 ms for the whole chain, with `overheads` learned."""
    costs = StepCosts(draft={2: {256: 1.3e-3}}, verify={PLAIN: {256: plain_cost}, 2: {256: 4.0e-3}, 16: {256: 40e-3}})
    policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
    policy.accepted[0], policy.seen[0] = 0.9, 1.0
    policy.overhead = dict(overheads)
    policy.ran(True, 250)
    return policy


def test_a_kind_that_proves_worse_than_its_faded_estimate_is_tried_again_later_each_time(monkeypatch):
    """While plain steps run, speculation's overhead estimate fades until it is tried again. A try that teaches it a
    higher overhead than it was chosen with doubles the wait before the next try at that rung (up to 16x): over 3,000
    steps where speculation never pays, it is tried 4-5 times instead of 21-24, each try a dwell of slow steps."""
    def policy():
        return plain_steps_running(3.0e-3, {(256, False): 2.2e-3, (256, True): 0.5e-3})

    backed_off = policy()
    starts = probe_starts(backed_off, 3000, 0.9)
    gaps = np.diff(starts)
    assert len(starts) <= 6 and all(later > 1.5 * earlier for earlier, later in zip(gaps, gaps[1:])), starts
    assert backed_off.probes_failed[256, False] == min(len(starts), verify_policy.PROBE_BACKOFF_MAX)
    monkeypatch.setattr(verify_policy, "PROBE_BACKOFF_MAX", 0)
    assert len(probe_starts(policy(), 3000, 0.9)) >= 3 * len(starts)


def test_a_kind_that_proves_no_worse_than_its_estimate_fades_at_the_full_rate_again():
    """The backoff lasts while tries fail: a try whose steps teach no higher overhead than it was chosen with clears it,
    and the next failed try starts it again from one."""
    costs = StepCosts(draft={2: {256: 1.3e-3}}, verify={PLAIN: {256: 3.0e-3}, 2: {256: 4.0e-3}})
    policy = VerifyPolicy(16, (PLAIN, 2, 16), costs)
    policy.probes_failed = {(256, False): 3}
    policy.overhead = {(256, False): 1.0e-3, (256, True): 0.5e-3}
    policy.ran(True, 250)
    policy.ran(False, 250)  # speculation chosen with an overhead of 1.0 ms
    for _ in range(KIND_DWELL):
        policy.observe_seconds(2, 250, 5.3e-3 + 0.8e-3)  # it takes 0.8 ms beyond its cost: no worse
        policy.ran(False, 250)
    policy.ran(True, 250)
    assert (256, False) not in policy.probes_failed
    policy.ran(False, 250)  # chosen again with the estimate of 0.8 ms it learned
    for _ in range(KIND_DWELL):
        policy.observe_seconds(2, 250, 5.3e-3 + 3.0e-3)  # now 3 ms beyond: worse than it was chosen with
        policy.ran(False, 250)
    policy.ran(True, 250)
    assert policy.probes_failed[256, False] == 1


def draining_speculative_steps(policy: VerifyPolicy, seed: int = 0) -> int:
    """Speculative steps among 300 of a batch draining from 250 to 100 requests, one request fewer every other step,
    with the step times an H200 took on the coding requests there: steady plain steps 3.0 ms, steady chains of 2
    6.3 ms, a switch's first steps as above, and the first plain step at each new rung host-bound (4.1 ms)."""
    rng = np.random.default_rng(seed)
    speculative, last_rung = 0, None
    for step in range(300):
        batch = 250 - step // 2
        rung = verify_policy.holding_rung((160, 192, 224, 256), batch) or 128
        q = policy.choose(batch)
        plain = q == PLAIN
        policy.ran(plain, batch)
        first = policy.kind_steps == 1 and step > 0
        wall = (4.8 if plain else 13.3) if first else (3.0 if plain else 6.3)
        if plain and rung != last_rung:
            wall, last_rung = 4.1, rung
        policy.observe_seconds(q, batch, wall * (1 + 0.05 * rng.standard_normal()) / 1e3)
        if not plain:
            speculative += 1
            policy.observe(np.minimum(rng.geometric(0.15, batch) - 1, q - 1).tolist(), q)
    return speculative


def test_a_rung_where_a_kind_has_not_run_yet_takes_its_estimate_from_the_nearest_rung(monkeypatch):
    """Under a draining load the batch enters a new rung every few dozen steps. A kind that has not run at that rung
    carries the nearest rung's estimate there (speculation is not free where it has not been measured), and a single
    host-bound step of the kind running refines that estimate instead of setting it alone. Speculation never pays
    here (1.85 / 6.3 against 1 / 3.0 tokens per ms) though its measured cost says it does (1.85 / 4.9 against 1 / 2.7):
    over the drain the policy runs at most two dwells of it, where without the borrowed estimates it speculated at
    every new rung, as it did on the H200."""
    rungs = (128, 160, 192, 224, 256)

    def policy():
        costs = StepCosts(draft={2: {r: 1.3e-3 for r in rungs}},
                          verify={PLAIN: {r: 2.7e-3 for r in rungs}, 2: {r: 3.6e-3 for r in rungs}})
        made = VerifyPolicy(16, (PLAIN, 2, 16), costs)
        made.accepted[0], made.seen[0] = 0.85, 1.0
        made.overhead = {(256, False): 1.4e-3, (256, True): 0.3e-3}  # learned at the full batch
        made.ran(True, 250)
        return made

    made = policy()
    made.ran(True, 250)
    made.ran(True, 200)  # a steady plain step (the third in a row) as the batch enters rung 224, new to both kinds
    assert made.overheads_at(200) == (pytest.approx(1.4e-3), pytest.approx(0.3e-3))
    made.observe_seconds(PLAIN, 200, 4.1e-3)  # a host-bound plain step: 1.4 ms beyond its cost
    assert made.overhead[224, True] == pytest.approx(0.9 * 0.3e-3 + 0.1 * 1.4e-3)
    assert made.choose(200) == PLAIN

    borrowed = max(draining_speculative_steps(policy(), seed) for seed in range(3))
    assert borrowed <= 2 * KIND_DWELL, borrowed
    monkeypatch.setattr(VerifyPolicy, "known_overhead", lambda self, rung, plain: self.overhead.get((rung, plain)))
    unborrowed = min(draining_speculative_steps(policy(), seed) for seed in range(3))
    assert unborrowed >= 3 * KIND_DWELL, unborrowed


def test_slow_plain_steps_among_steady_ones_do_not_set_off_tries_of_speculation(monkeypatch):
    """Steady plain steps of 3.02 ms (0.22 beyond their measured cost) against steady chains of 2 of 7.0 ms (1.9 tokens:
    speculation never pays), with 3% of the plain steps slow: counting each whole put plain steps' estimate above what
    they take and set off 181-422 speculative steps in 3,000; counted at most twice the median of the last 16
    (OUTLIER_FACTOR), the policy speculates for one dwell, as it does without slow steps."""
    def policy():
        return plain_steps_running(2.8e-3, {(256, False): 1.4e-3, (256, True): 0.3e-3})

    def speculative_steps(slow_plain: float, seed: int) -> int:  # of 3,000 at 250 requests, the H200's step times
        share, _, _ = simulate(policy(), 250, 2, {True: 3.02, False: 7.0}, {True: (4.8,), False: (13.3,)}, 0.9, 3000,
                               seed, slow_plain)
        return round((1 - share) * 3000)

    for seed in range(3):
        assert speculative_steps(0.0, seed) <= KIND_DWELL
        assert speculative_steps(0.03, seed) <= KIND_DWELL
    monkeypatch.setattr(verify_policy, "OUTLIER_FACTOR", math.inf)
    counted_whole = [speculative_steps(0.03, seed) for seed in range(3)]
    assert min(counted_whole) > 5 * KIND_DWELL, counted_whole

"""What a speculative step verifies: the whole chain, a shorter one, or a token tree, whichever pays.

    policy = VerifyPolicy(block_size, lengths=(16, 8, 4, 2), tree=True, costs=StepCosts(...))   # costs: None = chain
    q = policy.choose(batch, tree_nodes)   # q tokens per request (the anchor and the first q - 1 drafts), TREE or
                                           # a Budget; q = PLAIN (1): a plain decoding step, no draft
    policy.observe(accepted, q)            # how many drafts each request had accepted (a chain step)
    policy.observe_tree(accepted, nodes)   # the same for a tree step of `nodes` draft nodes per request
    policy.observe_budget(accepted, budget)  # the same for a budget step (Budget(q, per): blocks of q of which the
                                           # forward runs per rows a request on average, shared by the drafts'
                                           # confidence: specdec/runtime/row_budget.py)
    policy.ran(plain, batch)               # the kind of step the engine runs now (counted for KIND_DWELL)
    policy.observe_seconds(q, batch, s)    # a decode-only step's wall time: what a steady step (`steady`) takes
                                           # beyond its measured cost, or what a switch's steps take beyond steady ones

The drafter runs the whole block either way (one forward) but scores only the drafts the step verifies (its
output layer over the vocabulary grows with the batch like the target's); verifying fewer drafts saves target
work that grows with the batch, and a tree of more nodes accepts more than the chain at a verify cost that
barely grows while the batch is small. At batch 1 a verify of 64 tokens costs about what one of 16 does
(the step reads the weights once), so a large tree wins there; under load the drafts deep in the chain,
rarely accepted, cost as much target compute as the first ones, so short chains win. Per step the policy
picks the option that maximizes expected committed tokens per second: E / (draft(b) + verify(b)), both
measured for that option (a chain's draft scores its q - 1 drafts; a tree's drafts with candidates), but a
shorter chain only where it beats a longer one by more than the costs can tell apart (CHAIN_MARGIN).
For a chain of q, E(q) = 1 + sum over j < q of P(drafts 1..j all accepted), from running per-position
acceptance, counted only where it was observed (a step that verified q - 1 drafts says nothing of
position q onwards). For a tree, E is the running mean of committed tokens of tree steps of that node
count (before any, the chain's E(block) times a gain measured for trees of that size). Step times are
measured on this GPU at start-up (`StepCosts`); without them a step verifies the whole chain (or the
tree, if only trees are allowed).

A lone request verifies the whole chain: every chain length streams the weights once, so at batch 1 a shorter
chain saves no time, and only the whole chain gives a lone request's rows the bits of plain decoding (GEMMs of other
row counts may round differently; greedy speculation at batch 1 reproduces greedy decoding token for token). The
other options did not pay there either, and the costs measured at start-up could not tell: on an H200 (math500,
20 problems) chains of 8 took 3.11 ms a step against 3.04 for 16 though their costs put 8 4% below 16, and `auto`
taking them wherever the acceptance of positions 9-15 dipped ran at 0.72-0.80 ms per token against the chain's
0.67-0.70; with the whole chain, plain steps and trees left open at batch 1, `auto` took ~190 steps of another kind
and ran at 0.73-0.75 against 0.67-0.68; comparing trees by costs scaled by their steps' wall times, it took trees on
many steps (25.5 tokens verified a step) and ran at 0.76-0.81. A tree step's host work (its plans, the K/V moves)
makes it ~5.5 ms of wall time against the chain's ~3.0 while its GPU work is 3.5 ms; `--verify tree` runs trees at
batch 1.

Under heavy load the target's forward is compute-bound and even the anchor and one draft may cost more than they
commit; `auto` then also weighs a plain decoding step (PLAIN: the anchor alone, one token per request; its cost the
target's decode step), which the engine runs overlapped as plain decoding does (specdec/engine/flight.py) while the
drafter's context keeps up, so speculation resumes when the batch shrinks. The start-up costs are measured on short
contexts: under load both kinds of step take longer, by different amounts (a speculative step's host work is not
hidden behind the GPU as an overlapped plain step's is; its verify attends over the context with q tokens per
request, a plain step's with one; a plain step also writes the drafter's context). So what each kind takes beyond its
measured cost is learned from the wall time of decode-only steps, per batch rung, and added when the best speculative
option is weighed against a plain step (the speculative options are compared among themselves by their measured
costs). Steps with prompt chunks teach nothing, though a speculative one runs in order where a plain one overlaps
(one H100 at 250 coding requests: chains of 2 took 8.15 ms with a prompt and 5.97 without, plain steps 4.16 and
3.53): learning from them too, an overhead that follows ~10 steps jumped after each arrival, and at 128 math500
requests (draining) and 32-99 coding requests (sustained at 256) `auto` then ran 86-103 plain steps that delivered
0.33-0.36 tokens a request a ms where its speculative steps at those batches delivered 0.47-0.67 (1.45x against 1.55x
plain decoding, 1.00x against 1.01x; one H100, BENCHMARKS.md, 2026-12-06). A slow step among steady ones counts at
most twice the median of its kind's last 16 steady steps there (`OUTLIER_FACTOR`). A rung where a kind has not run
yet takes that kind's estimate from the nearest rung that has one, and its first steps refine it from there: under a
draining load the batch enters a new rung every few dozen steps, and with nothing known there speculation looked
free. On an H200 at 256 coding requests, each new rung from 224 down ran 8-24 speculative steps of 6-9 ms where plain
steps took 3 ms, and a single host-bound plain step (4.1 ms) set plain steps' estimate at a new rung alone; the
overheads of neighbouring rungs differed little there (speculative steps 1.2-1.5 ms at rungs 96-224, plain ones
0.4-0.5 ms at rungs 128-256). With the nearest rung's estimates, the same load speculated for 23-35 steps above 100
requests instead of 54-149 (BENCHMARKS.md).

Switching kind costs more than either kind's steady steps: the first speculative step after plain ones lands the
plain step in flight and drafts without a draft queued ahead, and the first two plain steps after speculative ones
wait for work queued at the switch. Only steady steps teach a kind's overhead (`steady`), and a kind once switched to
runs for KIND_DWELL steps. What a switch's steps take beyond steady ones is learned as the cost of switching to that
kind, and the kind not running pays it, spread over a dwell, when the two are weighed: where both deliver about the
same (on an H200 at 117-178 coding requests, steady chains of 4 took 6.0-7.7 ms and plain steps 3.3-3.6, while the
first speculative step after plain ones took 10-13), the kind running stays instead of switching every dwell. The kind
not running is tried again once its estimate has faded (`OTHER_KIND_FADE`); a try that proves it worse than the
estimate it was chosen with makes the next one at that rung wait twice as long (`PROBE_BACKOFF_MAX`).
Without the dwell and `steady`, on an H200 at 256 coding requests (max 512 tokens), `auto` fell into alternating two
plain steps with three speculative ones for hundreds of steps: the second plain step (6.3 ms, waiting for the first)
taught plain steps an overhead of 2-2.7 ms over a cost that steady plain steps (3.3-3.6 ms) exceed by 0.6, and the
run delivered 37.0k tokens/s where the two runs before it on the same engine delivered 48.2k and 48.4k (plain
decoding: 48.6-59.4k in the same job).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# acceptance counts decay by this factor per observed step: the estimate follows the current requests
# (a few hundred steps) rather than the whole run
DECAY = 0.995
# before any observation a position counts as accepted half the time (one pseudo-step of each)
PRIOR_ACCEPTED, PRIOR_SEEN = 1.0, 2.0
# a tree's expected tokens before any tree step of its size: the chain's times a gain that grows with the
# tree (measured from the shipped drafter's top-4 candidates: 15 nodes +18-25% over the chain, 31 nodes
# +28-31%, 63 nodes +34-37%)
def tree_prior_gain(nodes: int) -> float:
    return max(1.0, 1.2 + 0.05 * math.log2((nodes + 1) / 16))


TREE = 0  # the choice "verify a token tree" (chain choices are their token counts)


class Budget(NamedTuple):
    """The choice "a budget step": blocks of q tokens of which the step verifies on average `per` a request, each
    request's share by its drafts' confidence (specdec/runtime/row_budget.py)."""

    q: int
    per: int


# a budget step's expected tokens before any budget step of its kind: a chain of `per`'s times this, at most the chain
# of q's (giving the rows to the drafts most likely kept: the shipped drafter's math500 and coding runs, below)
BUDGET_PRIOR_GAIN = 1.1
# how finely the start-up costs tell chain lengths apart: at batch 1 they put a step verifying 16 tokens 4% above
# one verifying 8, where the steps' kernels differed by 2% and their wall time not at all (above). A shorter chain
# replaces a longer one only when its rate is higher by more than this (under load the options' costs differ by far
# more: at 64 requests a chain of 4 against one of 8, 3.4 against 4.7 ms)
CHAIN_MARGIN = 0.02
# an overhead estimate follows the last ~10 decode-only steps of its kind (speculative or plain) and batch rung
OVERHEAD_DECAY = 0.9
# a steady step counts at most twice the median of the last 16 steady steps of its kind there (once 8 are known): a few
# slow steps among steady ones say little of the next step; a lasting change shows in the median after 8 steps.
# On an H200 at 256 coding requests, 5-13 plain steps per run took 4-8.6 ms among ones of 3.0 (0.3 ms beyond their
# measured cost); counted whole, they set plain steps' estimate at 0.88-1.29 ms just before each try of speculation at
# 200 or more requests, tries whose 6.3-8.3 ms steps delivered 0.23-0.27 tokens a request per ms against plain steps'
# 0.31-0.33
OUTLIER_FACTOR, OUTLIER_WINDOW = 2.0, 16
# a step of one kind measures nothing of the other: the other's estimate fades by 1% each, so that after some
# dozens of steps of one kind the other is tried again and measured anew (no estimate stays stuck on an outlier)
OTHER_KIND_FADE = 0.99
# a kind switched to that proved to take more than its faded estimate said (a failed probe: its steps taught a higher
# overhead than it had when it was chosen) fades twice as slowly at that rung from then on, up to 2 ** PROBE_BACKOFF_MAX
# times; one that proved no worse fades at the full rate again. On an H200 under a sustained load of 256 coding requests,
# plain steps ran 85% of the steps and speculation, tried every ~100 plain steps for 8-step dwells of 7-11 ms steps
# against plain steps' 3.2, cost ~5% of the run's time
PROBE_BACKOFF_MAX = 4
PLAIN = 1  # the chain of the anchor alone: a plain decoding step
# steps a kind runs for once switched to: a switch costs a few ms beyond steady steps (the module's doc), so kinds
# alternating step by step lose what either would deliver alone; after 8 steps the switch is a few percent of the time
# spent in that kind, and the steady steps among them have refreshed its learned overhead
KIND_DWELL = 8
# steps of its kind a step must follow to be measured: a speculative step one (the first lands the plain step in
# flight), a plain step two (the second waits for the first's GPU work, queued behind what the switch left running)
STEADY_AFTER = {False: 1, True: 2}
# a switch's cost follows the last few switches into each kind (each a handful of steps)
SWITCH_DECAY = 0.7


def verify_lengths(block_size: int, policy: str, plain_steps: bool = False) -> tuple[int, ...]:
    """The chain lengths a speculative step may verify: the block ("chain"), also a half, three eighths, a quarter and
    an eighth of it, down to the anchor and one draft ("auto"; each length has CUDA graphs of its own: under heavy load
    the first draft alone, accepted most often, may pay where more do not), and with `plain_steps` the anchor alone
    (PLAIN), none ("tree": trees only). Three eighths sits between a half and a quarter because a chain's expected
    tokens grow ever more slowly with its length while its step's cost under load grows about in proportion: where
    chains of 4 and 8 deliver the same (the shipped drafter on math500 at 56-64 requests: 0.73 tokens a request a ms
    for both on one H100), one of 6 commits more than their mean for their mean cost."""
    if policy == "tree":
        return ()
    if policy == "chain":
        return (block_size,)
    shorter = {q for q in (block_size // 2, 3 * block_size // 8, block_size // 4, block_size // 8) if q >= 2}
    return tuple(sorted({block_size} | shorter | ({PLAIN} if plain_steps else set())))


def verify_budgets(lengths: tuple[int, ...], confidence: bool) -> tuple[Budget, ...]:
    """The budget steps `auto` may run (with a drafter that gives its drafts' confidence): on average an eighth, three
    sixteenths, five sixteenths and half of the block a request (2, 3, 5 and 8 of 16), each from the shortest chain
    length at least two longer (a request sure of its drafts may verify more than the average). With the shipped drafter
    on math500 (chains of 16 on a CPU, 1,262 request steps dealt into batches of 64; what budgets of the same rows would
    have accepted), tokens per request step: budgets 1.99 / 2.88 / 3.88 / 4.11 against chains of the same rows 1.84 /
    2.52 / 3.46 / 4.02 (budgets of 4 and 6 rows: 3.53 and 4.03, the latter what a chain of 8 accepts); blocks of 8
    lose little against 16 at these budgets and draft 7 scored drafts instead of 15 (BENCHMARKS.md). Each budget is a
    CUDA-graph ladder."""
    if not confidence or not lengths:
        return ()
    block = max(lengths)
    budgets = []
    for per in sorted({block // 8, 3 * block // 16, 5 * block // 16, block // 2} - {0, 1}):
        q = min((q for q in lengths if q >= per + 2), default=None)
        if q is not None:
            budgets.append(Budget(q, per))
    return tuple(budgets)


def holding_rung(rungs, batch: int) -> int | None:
    """The smallest of the measured batch sizes `rungs` that holds `batch` (the rung its step runs as); None above."""
    return next((r for r in sorted(rungs) if r >= batch), None)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at each captured batch size (a CUDA-graph rung), by option (a chain length q, or
    TREE): its draft step and its verify. A batch runs as the smallest rung that holds it."""

    draft: dict[int, dict[int, float]]  # option -> {rung: seconds} (an option missing: a drafter not measured)
    verify: dict[int, dict[int, float]]  # option -> {rung: seconds}
    # batch -> at(batch): the policy asks several times a step, and the costs never change once measured
    _at: dict[int, dict[int, float] | None] = field(default_factory=dict, compare=False, repr=False)

    def at(self, batch: int) -> dict[int, float] | None:
        """{option: seconds of a whole step} for a step of `batch` requests, each part at the smallest of its
        measured rungs that holds the batch; options whose verify is measured at none are left out (trees
        above the batches they are measured for). None when no chain length is measured there (above the
        ladder: an eager step, not measured)."""
        if batch not in self._at:
            self._at[batch] = self._measured_at(batch)
        return self._at[batch]

    def _measured_at(self, batch: int) -> dict[int, float] | None:
        def at_rung(by_rung: dict[int, float]) -> float | None:
            rung = holding_rung(by_rung, batch)
            return None if rung is None else by_rung[rung]

        verify = {q: seconds for q, by_rung in self.verify.items() if (seconds := at_rung(by_rung)) is not None}
        if not any(q != TREE for q in verify):
            return None
        return {q: seconds + (at_rung(self.draft.get(q, {})) or 0.0) for q, seconds in verify.items()}


class VerifyPolicy:
    def __init__(self, block_size: int, lengths: tuple[int, ...], costs: StepCosts | None = None,
                 tree: bool = False, budgets: tuple[Budget, ...] = ()):
        if (lengths and block_size not in lengths) or any(not 1 <= q <= block_size for q in lengths):
            raise ValueError(f"chain lengths {lengths} must lie in 1..{block_size} and include {block_size}")
        if not lengths and not tree:
            raise ValueError("a verify policy needs chain lengths or trees")
        self.block_size = block_size
        self.lengths = tuple(sorted(lengths))
        self.tree = tree
        self.budgets = tuple(budgets)
        if any(b.q not in self.lengths or not 2 <= b.per < b.q for b in self.budgets):
            raise ValueError(f"budget steps {self.budgets} need blocks among the chain lengths {self.lengths} and "
                             "2 <= per < q")
        self.costs = costs
        n = block_size - 1  # draft positions
        self.accepted = np.full(n, PRIOR_ACCEPTED)  # position i accepted, given 0..i-1 were
        self.seen = np.full(n, PRIOR_SEEN)  # position i verified with 0..i-1 accepted
        # a tree step's node count (TREE, nodes), or a Budget -> (decayed committed tokens, steps) of steps of that kind
        self.kind_tokens: dict[tuple[int, int] | Budget, tuple[float, float]] = {}
        # expected_tokens() until the next observation: the policy is asked several times a step
        self._expected: np.ndarray | None = None
        # (batch rung, plain step?) -> seconds a step of that kind takes beyond its measured cost
        self.overhead: dict[tuple[int, bool], float] = {}
        # (batch rung, plain step?) -> what its last OUTLIER_WINDOW steady steps took beyond their measured cost
        self.recent: dict[tuple[int, bool], deque[float]] = {}
        self.plain_running: bool | None = None  # the kind of the engine's last step (None: no step yet)
        self.kind_steps = 0  # steps of that kind in a row, the last one included
        # kind switched to (plain?) -> seconds its steps before the steady ones took beyond steady steps of it
        self.switch_seconds: dict[bool, float] = {}
        # the switch running now: (its steps measured so far, their seconds beyond steady steps); None once one of
        # its steps went unmeasured (a step with prompt chunks), or when no switch is running
        self._switch: tuple[int, float] | None = None
        # (batch rung, plain step?) -> failed probes of that kind there in a row (PROBE_BACKOFF_MAX at most): its
        # estimate fades 2 ** that times more slowly while the other kind runs
        self.probes_failed: dict[tuple[int, bool], int] = {}
        # the kind running now as it was switched to: (its rung, plain?, its overhead estimate then)
        self._entered: tuple[int, bool, float] | None = None

    @property
    def options(self) -> tuple[int | Budget, ...]:
        return self.lengths + ((TREE,) if self.tree else ()) + self.budgets

    def choose(self, batch: int, tree_nodes: int = 0, trees: bool = True, plain: bool = True,
               budgets: bool = True) -> int | Budget:
        """The chain length (tokens per request, anchor included), TREE or a Budget, for a step of `batch` requests;
        a tree step would verify `tree_nodes` draft nodes per request (`trees` False: chains only; `plain` False:
        not PLAIN, for a step that must speculate; `budgets` False: no budget step)."""
        if batch == 1 and self.block_size in self.lengths:  # a lone request: the whole chain (see the module's doc)
            return self.block_size
        options = [o for o in self.options if (trees or o != TREE) and (plain or o != PLAIN)
                   and (budgets or not isinstance(o, Budget))]
        seconds = self.costs.at(batch) if self.costs is not None and len(options) > 1 else None
        if seconds is None:
            return self.block_size if self.lengths or not trees else TREE
        expected = self.expected_tokens()

        def rate(option: int | Budget, extra: float = 0.0) -> float:
            if isinstance(option, Budget):
                tokens = self.expected_budget_tokens(option)
            else:
                tokens = self.expected_tree_tokens(tree_nodes) if option == TREE else expected[option - 1]
            return tokens / (seconds[option] + extra)

        def chain(option: int | Budget) -> bool:
            return not isinstance(option, Budget) and option not in (TREE, PLAIN)

        # the speculative options compared by their measured costs; the best of them against a plain step, each
        # with the overhead learned for its kind at this rung (ties: the one verifying more tokens)
        speculative = [o for o in options if o in seconds and o != PLAIN]
        best = max(speculative, key=lambda option: (rate(option), option.per if isinstance(option, Budget) else option)
                   ) if speculative else PLAIN
        if chain(best):  # the longest chain whose rate is within the margin of the best one's
            best = max(o for o in speculative if chain(o) and o >= best and rate(o) * (1 + CHAIN_MARGIN) >= rate(best))
        if PLAIN in options and PLAIN in seconds:
            if self.plain_running is not None and self.kind_steps < KIND_DWELL:  # a kind just switched to stays
                return PLAIN if self.plain_running else best
            speculative_overhead, plain_overhead = self.overheads_at(batch)
            # the kind not running now also pays for switching to it, spread over the dwell it would run for: where
            # the two kinds deliver about the same, the one running stays
            if self.plain_running:
                speculative_overhead += self.switch_cost(False) / KIND_DWELL
            elif self.plain_running is False:
                plain_overhead += self.switch_cost(True) / KIND_DWELL
            if best == PLAIN or rate(PLAIN, plain_overhead) > rate(best, speculative_overhead):
                return PLAIN
        return best

    def ran(self, plain: bool, batch: int | None = None) -> None:
        """The engine runs a step of this kind now (a plain step, or a speculative one) for `batch` requests: from here
        on `choose` answers for the step after it. Leaving a kind judges the switch to it (`probes_failed`)."""
        if plain != self.plain_running:
            self._switch = (0, 0.0) if self.plain_running is not None else None
            self._judge_probe()
            rung = self._rung(batch) if batch is not None else None
            self._entered = None if rung is None else (rung, plain, self.known_overhead(rung, plain) or 0.0)
        self.kind_steps = self.kind_steps + 1 if plain == self.plain_running else 1
        self.plain_running = plain

    def _judge_probe(self) -> None:
        """The kind running until now is left: if its steps taught its rung a higher overhead than it was chosen with
        (its estimate had faded below what it takes), the next try of it there waits twice as long; if not, the
        estimate it was chosen with held, and it fades at the full rate again."""
        if self._entered is None:
            return
        rung, plain, estimate = self._entered
        self._entered = None
        if (self.known_overhead(rung, plain) or 0.0) > estimate:
            self.probes_failed[rung, plain] = min(self.probes_failed.get((rung, plain), 0) + 1, PROBE_BACKOFF_MAX)
        else:
            self.probes_failed.pop((rung, plain), None)

    def steady(self, plain: bool) -> bool:
        """Whether the step running now (of this kind) follows enough steps of its kind that its wall time holds no
        switch (STEADY_AFTER): only such steps teach the overheads."""
        return self.plain_running == plain and self.kind_steps > STEADY_AFTER[plain]

    def observe_seconds(self, option: int, batch: int, seconds: float) -> None:
        """A decode-only step of `batch` requests that chose `option` (PLAIN: a plain step, overlapped) took `seconds`
        of wall time. A steady step (`steady`; every step while the policy is told no kinds, `ran`): what it took
        beyond its measured cost updates the overhead of its kind at its batch rung, and the other kind's estimate there
        fades. A step of a switch: what it took beyond a steady step of its kind counts towards the switch's cost
        (`switch_cost`)."""
        predicted = (self.costs.at(batch) or {}).get(option) if self.costs is not None else None
        rung = self._rung(batch)
        plain = option == PLAIN
        if self.plain_running is not None and not self.steady(plain):
            overhead = self.known_overhead(rung, plain)  # what a steady step of this kind takes beyond its cost
            self._observe_switch(None if predicted is None or overhead is None else seconds - predicted - overhead)
            return
        if predicted is None or rung is None:
            return
        extra = max(seconds - predicted, 0.0)
        recent = self._recent(rung, plain)
        enough_steps = len(recent) >= OUTLIER_WINDOW // 2
        counted = min(extra, OUTLIER_FACTOR * statistics.median(recent)) if enough_steps else extra
        recent.append(extra)
        known = self.known_overhead(rung, plain)
        self.overhead[rung, plain] = counted if known is None else (
            OVERHEAD_DECAY * known + (1 - OVERHEAD_DECAY) * counted)
        if (rung, not plain) in self.overhead:
            self.overhead[rung, not plain] *= OTHER_KIND_FADE ** (0.5 ** self.probes_failed.get((rung, not plain), 0))

    def _recent(self, rung: int, plain: bool) -> deque[float]:
        """The last steady steps' overheads of this kind at `rung` (OUTLIER_WINDOW); at a rung new to the kind, the
        nearest rung's, whose estimate it starts from (`known_overhead`)."""
        if (rung, plain) not in self.recent:
            source = self._estimated_from(rung, plain)
            self.recent[rung, plain] = deque(self.recent.get(source, ()), maxlen=OUTLIER_WINDOW)
        return self.recent[rung, plain]

    def _observe_switch(self, extra: float | None) -> None:
        """A step of the switch running now took `extra` seconds beyond a steady step of its kind (None: unknown).
        Once all its steps before the steady ones are measured, their sum updates the cost of switching to its kind."""
        if self._switch is None or extra is None or self._switch[0] != self.kind_steps - 1:
            self._switch = None  # a step of it unmeasured: its cost is unknown
            return
        steps, seconds = self._switch[0] + 1, self._switch[1] + extra
        self._switch = (steps, seconds)
        if steps == STEADY_AFTER[self.plain_running]:
            known = self.switch_seconds.get(self.plain_running)
            self.switch_seconds[self.plain_running] = seconds if known is None else (
                SWITCH_DECAY * known + (1 - SWITCH_DECAY) * seconds)
            self._switch = None

    def switch_cost(self, plain: bool) -> float:
        """Seconds a switch to plain steps (or to speculation) is learned to cost beyond steady steps: the steps after a
        switch wait for work the switch left queued, and the first speculative step drafts without a draft queued ahead
        (a kind's first steps may also take less than steady ones: it is their sum that counts)."""
        return max(self.switch_seconds.get(plain, 0.0), 0.0)

    def overheads_at(self, batch: int) -> tuple[float, float]:
        """(speculative, plain) seconds a step of `batch` requests is learned to take beyond its measured cost (0 where
        nothing is learned yet): what `choose` adds when it weighs the two kinds."""
        rung = self._rung(batch)
        return self.known_overhead(rung, False) or 0.0, self.known_overhead(rung, True) or 0.0

    def known_overhead(self, rung: int | None, plain: bool) -> float | None:
        """Seconds a step of this kind is learned to take beyond its measured cost at `rung`: the rung's own estimate,
        else the nearest rung's that has one (the larger of two as near), None where none has (see the module's doc)."""
        source = self._estimated_from(rung, plain)
        return None if source is None else self.overhead[source]

    def _estimated_from(self, rung: int | None, plain: bool) -> tuple[int, bool] | None:
        """The (rung, kind) whose estimate `known_overhead` gives for this kind at `rung`."""
        if (rung, plain) in self.overhead:
            return rung, plain
        if rung is None:
            return None
        nearest = min(((abs(r - rung), -r) for r, p in self.overhead if p == plain), default=None)
        return None if nearest is None else (-nearest[1], plain)

    def _rung(self, batch: int) -> int | None:
        """The measured batch size a step of `batch` requests runs as (the whole chain's verify rungs)."""
        if self.costs is None:
            return None
        by_rung = self.costs.verify.get(self.block_size) or next(iter(self.costs.verify.values()), {})
        return holding_rung(by_rung, batch)

    def expected_tree_tokens(self, nodes: int) -> float:
        """Expected committed tokens per request of a tree step with `nodes` draft nodes."""
        mean = self._mean_tokens((TREE, nodes))
        return self.expected_tokens()[-1] * tree_prior_gain(nodes) if mean is None else mean

    def expected_budget_tokens(self, budget: Budget) -> float:
        """Expected committed tokens per request of a budget step of this kind."""
        mean = self._mean_tokens(budget)
        if mean is None:
            expected = self.expected_tokens()
            return min(expected[budget.per - 1] * BUDGET_PRIOR_GAIN, expected[budget.q - 1])
        return mean

    def observe_budget(self, accepted: list[int], budget: Budget) -> None:
        """A budget step of this kind; request r had accepted[r] drafts."""
        self._add_tokens(budget, accepted)

    def observe_tree(self, accepted: list[int], nodes: int) -> None:
        """A tree step of `nodes` draft nodes per request; request r had accepted[r] drafts."""
        self._add_tokens((TREE, nodes), accepted)

    def _mean_tokens(self, kind) -> float | None:
        """The running mean of committed tokens per request of steps of `kind` (None before one)."""
        tokens, steps = self.kind_tokens.get(kind, (0.0, 0.0))
        return tokens / steps if steps >= 1 else None

    def _add_tokens(self, kind, accepted: list[int]) -> None:
        tokens, steps = self.kind_tokens.get(kind, (0.0, 0.0))
        self.kind_tokens[kind] = (tokens * DECAY + sum(a + 1 for a in accepted) / len(accepted), steps * DECAY + 1)

    def expected_tokens(self) -> np.ndarray:
        """[block_size]: expected committed tokens per request when verifying q tokens, at index q - 1."""
        if self._expected is None:
            reach = np.cumprod(self.accepted / self.seen)  # P(drafts 1..j all accepted), j = 1..n
            self._expected = 1.0 + np.concatenate([[0.0], np.cumsum(reach)])
        return self._expected

    def observe(self, accepted: list[int], q: int) -> None:
        """A step verified q tokens per request and request r had accepted[r] of its q - 1 drafts."""
        self._expected = None
        self.accepted *= DECAY
        self.seen *= DECAY
        # positions 0..a-1 were accepted; position a (if verified) was rejected; beyond it, unseen: position j
        # was verified by the requests with at least j drafts accepted (j < q - 1: one of the drafts verified) and
        # accepted by those with more than j, all counted at once from one histogram
        a = np.asarray(accepted, dtype=np.int64)
        at_or_past = np.cumsum(np.bincount(a, minlength=len(self.seen) + 1)[::-1])[::-1]  # [j]: how many a >= j
        self.seen[:q - 1] += at_or_past[:q - 1]
        self.accepted += at_or_past[1:]

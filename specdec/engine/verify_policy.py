"""How many drafts a speculative step verifies: the whole chain, or as many as pay for themselves.

    policy = VerifyPolicy(block_size, lengths=(16, 8, 4), costs=StepCosts(...))   # costs: None = chain
    q = policy.choose(batch)          # verify q tokens per request: the anchor and the first q - 1 drafts
    policy.observe(accepted, q)       # how many drafts each request had accepted

The drafter proposes a whole block either way (one forward); verifying fewer drafts saves target work
that grows with the batch. At batch 1 a verify of 16 tokens costs about what one of 4 does (the step
reads the weights once), so the whole chain is verified; under load the drafts deep in the chain,
rarely accepted, cost as much target compute as the first ones. Per step the policy picks the length q
that maximizes expected committed tokens per second: E(q) / (draft(b) + verify(b, q)), with
E(q) = 1 + sum over j < q of P(drafts 1..j all accepted), from running per-position acceptance, and the
step times measured on this GPU at start-up (`StepCosts`). Acceptance is counted per position only
where it was observed: a step that verified q - 1 drafts says nothing of position q onwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# acceptance counts decay by this factor per observed step: the estimate follows the current requests
# (a few hundred steps) rather than the whole run
DECAY = 0.995
# before any observation a position counts as accepted half the time (one pseudo-step of each)
PRIOR_ACCEPTED, PRIOR_SEEN = 1.0, 2.0


def verify_lengths(block_size: int, policy: str) -> tuple[int, ...]:
    """The chain lengths a speculative step may verify: the block ("chain"), or also half and a quarter of
    it ("auto"; each length has CUDA graphs of its own)."""
    if policy in ("chain", "tree"):  # a tree verifies as many tokens as the chain
        return (block_size,)
    return tuple(sorted({block_size} | {q for q in (block_size // 2, block_size // 4) if q >= 2}))


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step at each captured batch size (a CUDA-graph rung): the draft step, and the verify
    of each chain length. A batch runs as the smallest rung that holds it."""

    draft: dict[int, float]  # rung -> seconds (empty: a drafter without a measured step)
    verify: dict[int, dict[int, float]]  # q -> {rung: seconds}

    def at(self, batch: int) -> tuple[float, dict[int, float]] | None:
        """(draft seconds, {q: verify seconds}) for a step of `batch` requests; None above the ladder (an
        eager step, not measured)."""
        rungs = sorted(set.intersection(*(set(by_rung) for by_rung in self.verify.values())))
        rung = next((r for r in rungs if r >= batch), None)
        if rung is None:
            return None
        return self.draft.get(rung, 0.0), {q: by_rung[rung] for q, by_rung in self.verify.items()}


class VerifyPolicy:
    def __init__(self, block_size: int, lengths: tuple[int, ...], costs: StepCosts | None = None):
        if block_size not in lengths or any(not 2 <= q <= block_size for q in lengths):
            raise ValueError(f"chain lengths {lengths} must lie in 2..{block_size} and include {block_size}")
        self.block_size = block_size
        self.lengths = tuple(sorted(lengths))
        self.costs = costs
        n = block_size - 1  # draft positions
        self.accepted = np.full(n, PRIOR_ACCEPTED)  # position i accepted, given 0..i-1 were
        self.seen = np.full(n, PRIOR_SEEN)  # position i verified with 0..i-1 accepted

    def choose(self, batch: int) -> int:
        """The chain length (tokens per request, anchor included) for a step of `batch` requests."""
        costs = self.costs.at(batch) if self.costs is not None and len(self.lengths) > 1 else None
        if costs is None:
            return self.block_size
        draft, verify = costs
        expected = self.expected_tokens()
        return max(self.lengths, key=lambda q: (expected[q - 1] / (draft + verify[q]), q))

    def expected_tokens(self) -> np.ndarray:
        """[block_size]: expected committed tokens per request when verifying q tokens, at index q - 1."""
        reach = np.cumprod(self.accepted / self.seen)  # P(drafts 1..j all accepted), j = 1..n
        return 1.0 + np.concatenate([[0.0], np.cumsum(reach)])

    def observe(self, accepted: list[int], q: int) -> None:
        """A step verified q tokens per request and request r had accepted[r] of its q - 1 drafts."""
        self.accepted *= DECAY
        self.seen *= DECAY
        for a in accepted:
            # positions 0..a-1 were accepted; position a (if verified) was rejected; beyond it, unseen
            verified = min(a + 1, q - 1)
            self.seen[:verified] += 1
            self.accepted[:a] += 1

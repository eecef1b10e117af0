"""Verify rows shared out among a step's requests by the drafter's confidence: a budget step.

    reach = budget_reach(confidence, rung, per)          # [rung, n]: log P(drafts 1..j all right), as drafted
    lengths = budget_lengths(reach, rung * per)          # [rung]: rows each request verifies, anchor included
    request, column = compact_rows(lengths, rung * per)  # each verified row's request and place in its block

A chain step verifies the same q tokens of every request, though a request whose drafter is sure of its next eight
drafts will likely keep them all, and one unsure of its first will likely keep none. A budget step verifies on
average `per` tokens a request but gives each draft row to the drafts most likely to be kept, step-wide: a request's
first j drafts are all kept with probability about the product of their drafted probabilities, so the rows go to the
largest of those products over every request and position (best-first, as a token tree grows). A request gets at
least its anchor; its drafts verified are always a prefix of its block. The target's forward then runs over exactly
those rows, which is what its GEMMs cost under load; attention still sees each request's block as a chain of q
(`specdec/runtime/target_runner.py`), and the rows left out are never attended to or accepted.

All three are fixed-shape tensor functions without a host round trip, so that the step replays as one CUDA graph.
"""

from __future__ import annotations

import torch

# what a padding request's reach takes in a graph rung wider than the batch: its first per - 1 positions outrank every
# real draft and the rest fall below all of them, so the real requests share exactly batch * per rows, as they do
# when the step runs eagerly over the batch alone
SURE, NEVER = 1e30, -1e30


def budget_reach(confidence: torch.Tensor, rung: int, per: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[rung, n] float32: each position's log-probability that it and every draft before it are right as drafted
    (the running sum of `confidence` [batch, n], the drafts' own log-probabilities), then `rung - batch` padding
    requests that take per - 1 draft rows each (SURE, NEVER)."""
    batch, n = confidence.shape
    reach = out if out is not None else torch.empty(rung, n, dtype=torch.float32, device=confidence.device)
    torch.cumsum(confidence.float(), dim=1, out=reach[:batch])
    if rung > batch:
        reach[batch:, :per - 1] = SURE
        reach[batch:, per - 1:] = NEVER
    return reach


def budget_lengths(reach: torch.Tensor, rows: int) -> torch.Tensor:
    """[B] int64: tokens each request verifies (its anchor and its first drafts) when the step verifies `rows` in all
    (B <= rows <= B * (n + 1)): the anchors, and the rows - B draft positions of largest reach. Ties may pick a
    position past one left out: a request's count alone decides, so its rows stay a prefix."""
    batch, n = reach.shape
    if not batch <= rows <= batch * (n + 1):
        raise ValueError(f"a budget of {rows} rows cannot cover {batch} requests of at most {n + 1} tokens each")
    counts = torch.ones(batch, dtype=torch.long, device=reach.device)
    if rows > batch:
        chosen = reach.flatten().topk(rows - batch, sorted=False).indices
        counts.scatter_add_(0, torch.div(chosen, n, rounding_mode="floor"), torch.ones_like(chosen))
    return counts


def compact_rows(lengths: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, column), each [rows] int64: the k-th verified row is column `column[k]` of request `request[k]`'s
    block, request by request (sum(lengths) == rows)."""
    ends = lengths.cumsum(0)
    k = torch.arange(rows, device=lengths.device)
    request = torch.searchsorted(ends, k, right=True)
    return request, k - (ends - lengths)[request]

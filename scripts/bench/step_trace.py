"""A load level's step trace (`LoadRow.steps`) summed by decode batch and kind of step: where the level's time went
and what each kind of step delivered per request at that batch, the comparison `auto` makes at every step.

    rows = trace_bins(row.steps)     # one TraceBin per (batch range, kind) that ran
    print(trace_table([(row.system, row.concurrency, trace_bins(row.steps)) for row in rows]))
    load_rate(row.steps, row.concurrency)   # (tokens a request a ms, share of time) at the level's own load
    print(prompt_step_table([(row.system, row.concurrency, row.steps) for row in rows]))  # steps with a prompt

Budget steps (auto's rows shared by the drafts' confidence) are a kind of their own where the trace names each step's
kind, so that a run with them sets their rate against its chains' at the same batch.

Tokens per request: a speculative step's own committed tokens (the first one after plain steps also lands the plain
step in flight, so it counts a token per request more), one per request for a plain step (an overlapped step
commits its predecessor's tokens; each commits one per request).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# decode batch ranges, largest first: under load the full batch, the shrinking middle, the tail
BATCH_BINS = ((200, None), (100, 199), (32, 99), (1, 31))


@dataclass
class TraceBin:
    batches: str  # e.g. "100-199", ">= 200"
    kind: str  # "plain", "speculative" or "budget" (`step_kind`)
    steps: int
    wall_ms: float  # summed
    median_ms: float
    mean_batch: float
    tokens_per_request: float  # per step
    tokens_per_request_ms: float  # per request per ms of step
    waited_ms: float | None = None  # median time the host waited for the GPU in a step (~0: host-bound steps)


def step_kind(step: list) -> str:
    """"plain" (one token verified per request, or a run without a drafter), "budget" (a budget step: traces that
    name each step's kind) or "speculative" (a chain or a token tree)."""
    if step[3] in (None, 1):
        return "plain"
    return "budget" if len(step) > 10 and (step[10] or "").startswith("budget") else "speculative"


def delivered(step: list) -> int:
    """Tokens a decode-only step delivered (the module's "Tokens per request", summed over its requests)."""
    return step[1] if step_kind(step) == "plain" else step[6]


def trace_bins(steps: list[list]) -> list[TraceBin]:
    """Decode-only steps (no prompt chunk) summed by batch range and kind (`step_kind`)."""
    bins = []
    for low, high in BATCH_BINS:
        for kind in ("plain", "speculative", "budget"):
            picked = [s for s in steps if not s[0] and s[1] >= low and (high is None or s[1] <= high)
                      and step_kind(s) == kind]
            if not picked:
                continue
            requests = sum(s[1] for s in picked)
            tokens = sum(map(delivered, picked))
            wall = sum(s[2] for s in picked)
            waits = [s[9] for s in picked if len(s) > 9]  # (traces written before waits were recorded lack them)
            bins.append(TraceBin(f">= {low}" if high is None else f"{low}-{high}", kind, len(picked), wall,
                                 statistics.median(s[2] for s in picked), requests / len(picked), tokens / requests,
                                 tokens / requests / (wall / len(picked)), statistics.median(waits) if waits else None))
    return bins


def at_load(steps: list[list], concurrency: int) -> list[list]:
    """The steps that ran at least half the level's concurrency: the level's own load."""
    return [s for s in steps if 2 * s[1] >= concurrency]


def load_rate(steps: list[list], concurrency: int) -> tuple[float, float] | None:
    """Tokens a request a ms over the decode-only steps of at least half the level's concurrency, every kind together
    (tokens / the sum of batch x wall ms), and those steps' share of the decode-only steps' wall time; None where no
    such step ran. A level's tokens/s also counts the tail its last requests decode in fewer company (where
    speculation gains most, and the longer the answers the longer the tail): this is the rate at the level's own
    load."""
    decode = [s for s in steps if not s[0] and s[1]]
    loaded = at_load(decode, concurrency)
    if not loaded:
        return None
    rate = sum(map(delivered, loaded)) / sum(s[1] * s[2] for s in loaded)
    return rate, sum(s[2] for s in loaded) / sum(s[2] for s in decode)


def trace_table(levels: list[tuple[str, int, list[TraceBin]]]) -> str:
    """Markdown: one line per (system, concurrency, batch range, kind)."""
    lines = ["| system | concurrency | decode batch | kind | steps | wall ms | median ms | host's wait for the GPU, "
             "median ms | mean batch | tokens per request | per request per ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, concurrency, bins in levels:
        lines += [f"| {system} | {concurrency} | {b.batches} | {b.kind} | {b.steps} | {b.wall_ms:.1f} | "
                  f"{b.median_ms:.2f} | {'-' if b.waited_ms is None else f'{b.waited_ms:.2f}'} | {b.mean_batch:.0f} | "
                  f"{b.tokens_per_request:.2f} | {b.tokens_per_request_ms:.3f} |" for b in bins]
    return "\n".join(lines)


# requests a step with prompt chunks admitted: 0 (chunks of earlier admissions only), 1, 2, 3, 4 or more
ADMITTED_BINS = ((0, 0), (1, 1), (2, 2), (3, 3), (4, None))


def prompt_step_table(levels: list[tuple[str, int, list[list]]]) -> str:
    """Markdown: the steps with prompt chunks of each level by how many requests they admitted, beside the level's
    decode-only steps of at least half its concurrency: what a step with arrivals costs over one without, and how
    much of that grows with its arrivals and prompt tokens. Traces written before prompt tokens were recorded (12
    fields or fewer) give no lines."""
    lines = ["| system | concurrency | requests admitted | steps | median ms | median prompt tokens | mean decode batch "
             "| decode-only steps at load, median ms |", "|---|---|---|---|---|---|---|---|"]
    for system, concurrency, steps in levels:
        loaded = at_load([s for s in steps if not s[0]], concurrency)
        base = f"{statistics.median(s[2] for s in loaded):.2f}" if loaded else "-"
        prompt = [s for s in steps if s[0] and len(s) > 12 and s[1]]  # beside decoding requests
        for low, high in ADMITTED_BINS:
            picked = [s for s in prompt if s[12] >= low and (high is None or s[12] <= high)]
            if picked:
                lines.append(f"| {system} | {concurrency} | {low if high == low else f'>= {low}'} | {len(picked)} | "
                             f"{statistics.median(s[2] for s in picked):.2f} | "
                             f"{statistics.median(s[11] for s in picked):.0f} | "
                             f"{statistics.mean(s[1] for s in picked):.0f} | {base} |")
    return "\n".join(lines)

"""One load level's numbers from its request records (`scripts/bench_serve.py`), as `vllm bench serve`
defines them:

- throughputs over the level's duration (first request sent to last answer): requests/s, output
  tokens/s, total (prompt + output) tokens/s, counting successful requests only;
- TTFT, TPOT, ITL and e2e in ms as mean, median, p90 and p99 (numpy's linear interpolation) over the
  successful requests (ITL: over all their chunk gaps pooled; TPOT: requests of at least 2 tokens);
- ITL per token: chunk gaps divided by their request's tokens per chunk (`RequestRecord.per_token_gaps_s`);
- tokens per chunk: completion tokens / content chunks over all successful requests (for a speculative
  server, close to its acceptance length as the client sees it);
- conversations (records of turns after the first): TTFT of first turns and of later turns apart, and
  the share of later turns' prompt tokens the server reported cached (None where it reports none).
"""

from __future__ import annotations

import numpy as np

from scripts.bench.chat_request import RequestRecord

STATISTICS = ("mean", "median", "p90", "p99")


def describe_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, median, p90, p99 of seconds, in milliseconds (None for no values)."""
    if not values_s:
        return dict.fromkeys(STATISTICS)
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "median": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(records: list[RequestRecord], duration_s: float) -> dict:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.completion_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    chunks = sum(r.content_chunks for r in done)

    def per_second(amount: float) -> float | None:
        return amount / duration_s if duration_s > 0 else None

    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(prompt_tokens + output_tokens),
        "tokens_per_chunk": output_tokens / chunks if chunks else None,
        "ttft_ms": describe_ms([r.ttft_s for r in done]),
        "tpot_ms": describe_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": describe_ms([gap for r in done for gap in r.chunk_gaps_s]),
        "itl_per_token_ms": describe_ms([gap for r in done for gap in r.per_token_gaps_s]),
        "e2e_ms": describe_ms([r.e2e_s for r in done]),
        "errors": first_errors(records),
        **turn_summary(done),
    }


def turn_summary(done: list[RequestRecord]) -> dict:
    """First against later turns of conversations (nothing for single-turn requests)."""
    later = [r for r in done if r.turn > 0]
    if not later:
        return {}
    reported = [r for r in later if r.cached_tokens is not None and r.prompt_tokens]
    return {
        "ttft_first_turn_ms": describe_ms([r.ttft_s for r in done if r.turn == 0]),
        "ttft_later_turns_ms": describe_ms([r.ttft_s for r in later]),
        "later_turns": len(later),
        "cached_share_later_turns": (sum(r.cached_tokens for r in reported) / sum(r.prompt_tokens for r in reported)
                                     if reported else None),
    }


def first_errors(records: list[RequestRecord], limit: int = 5) -> dict[str, int]:
    """The distinct error messages (at most `limit`) and how many requests had each."""
    counts: dict[str, int] = {}
    for r in records:
        if r.error is not None and (r.error in counts or len(counts) < limit):
            counts[r.error] = counts.get(r.error, 0) + 1
    return counts

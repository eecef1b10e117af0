"""Speculative run vs the autoregressive baseline on the same prompts: speed, accuracy, identity.

At temperature 0 speculation is lossless in exact arithmetic, so outputs should match token for
token; a difference points at numerics (bf16/FP8 logits that tie or nearly tie, batch-shape
dependent kernels). Each differing output is listed with its first differing position so that the
two continuations can be inspected from there.
"""

from __future__ import annotations

from eval.runner import Run


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def compare(spec: Run, base: Run, ids: list[str], tokenizer=None) -> dict:
    """Speedup (baseline TPOT / speculative TPOT), both accuracies and the identical-output fraction."""
    differing = []
    for i, (s, b) in enumerate(zip(spec.results, base.results)):
        pos = first_difference(s.token_ids, b.token_ids)
        if pos is None:
            continue
        entry = {"index": i, "id": ids[i], "first_diff": pos, "spec_tokens": len(s.token_ids),
                 "baseline_tokens": len(b.token_ids),
                 "spec_token": s.token_ids[pos] if pos < len(s.token_ids) else None,
                 "baseline_token": b.token_ids[pos] if pos < len(b.token_ids) else None,
                 "same_extracted": spec.extracted[i] == base.extracted[i]}
        if tokenizer is not None:  # a little decoded context makes the divergence readable
            entry["context"] = tokenizer.decode(s.token_ids[max(0, pos - 8):pos])
            entry["spec_next"] = tokenizer.decode(s.token_ids[pos:pos + 8])
            entry["baseline_next"] = tokenizer.decode(b.token_ids[pos:pos + 8])
        differing.append(entry)
    n = len(spec.results)
    return {
        "speedup_tpot": _ratio(base.summary.tpot_s, spec.summary.tpot_s),
        "speedup_tokens_per_s": _ratio(spec.summary.tokens_per_s, base.summary.tokens_per_s),
        "accuracy_speculative": spec.accuracy,
        "accuracy_baseline": base.accuracy,
        "identical_fraction": (n - len(differing)) / n if n else 0.0,
        "differing": differing,
    }

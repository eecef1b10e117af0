"""Aggregation and Markdown tables for `scripts/bench_peers.py`.

Per system (batch 1): median TPOT and TTFT over prompts, end-to-end tokens/s (all generated tokens /
all wall time of the timed calls), tau as the mean of per-prompt values (z-lab's convention), and
generated tokens. Speedups are TPOT ratios (reference median / system median) over the prompts both
systems ran, so a system cut short by a time budget is compared on the same prompts. same-as-AR: the
fraction of shared prompts whose generated token ids equal ours-ar's.
"""

from __future__ import annotations

import math
import statistics

HF_BASELINE = "hf-generate"
AR_BASELINE = "ours-ar"


def _finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def median(values) -> float | None:
    values = _finite(values)
    return statistics.median(values) if values else None


def mean(values) -> float | None:
    values = _finite(values)
    return statistics.fmean(values) if values else None


def summarize(records: list[dict]) -> dict:
    generated = sum(r["generated_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    tpot, ttft = median(r["tpot_s"] for r in records), median(r["ttft_s"] for r in records)
    return {
        "prompts": len(records),
        "generated_tokens": generated,
        "generated_tokens_median": median(r["generated_tokens"] for r in records),
        "tpot_ms_median": None if tpot is None else tpot * 1e3,
        "ttft_ms_median": None if ttft is None else ttft * 1e3,
        "tokens_per_s": generated / wall if wall > 0 else None,
        "wall_s": wall,
        "tau_mean": mean(r["tau"] for r in records),
        "target_forwards": sum(r["target_forwards"] or 0 for r in records),
    }


def _by_index(records: list[dict]) -> dict[int, dict]:
    return {r["index"]: r for r in records}


def tpot_speedup(reference: list[dict], records: list[dict]) -> float | None:
    """median TPOT of `reference` / median TPOT of `records`, over the prompts both have a TPOT for."""
    ref, mine = _by_index(reference), _by_index(records)
    common = [i for i in ref if i in mine and ref[i]["tpot_s"] and mine[i]["tpot_s"]]
    a, b = median(ref[i]["tpot_s"] for i in common), median(mine[i]["tpot_s"] for i in common)
    return a / b if a and b else None


def first_difference(a: list[int], b: list[int]) -> int | None:
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(reference: list[dict], records: list[dict]) -> dict:
    """Which shared prompts produced exactly the reference's token ids; the first differing position otherwise."""
    ref, mine = _by_index(reference), _by_index(records)
    common = [i for i in ref if i in mine]
    diffs = {i: first_difference(ref[i]["token_ids"], mine[i]["token_ids"]) for i in common}
    same = [i for i in common if diffs[i] is None]
    return {"compared": len(common), "identical": len(same),
            "fraction": len(same) / len(common) if common else None,
            "differing": [{"index": i, "first_diff": d} for i, d in diffs.items() if d is not None]}


def system_rows(systems: dict[str, dict]) -> dict[str, dict]:
    """Each run system's summary plus speedups and the comparison with ours-ar (None where not applicable)."""
    rows = {}
    for name, system in systems.items():
        records = system["prompts"]
        row = dict(summarize(records))
        for key, base in (("speedup_vs_hf", HF_BASELINE), ("speedup_vs_ours_ar", AR_BASELINE)):
            row[key] = tpot_speedup(systems[base]["prompts"], records) if base in systems else None
        row["same_as_ar"] = compare_outputs(systems[AR_BASELINE]["prompts"], records) if AR_BASELINE in systems \
            else None
        rows[name] = row
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def latency_table(rows: dict[str, dict], skipped: dict[str, str]) -> str:
    lines = ["| system | TPOT ms | tok/s | tau | speedup vs HF | speedup vs ours-AR | same-as-AR | TTFT ms "
             "| generated tokens | prompts |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        same = r["same_as_ar"]
        same_text = "-" if same is None or not same["compared"] else f"{same['identical']}/{same['compared']}"
        lines.append(f"| {name} | {_fmt(r['tpot_ms_median'], '.2f')} | {_fmt(r['tokens_per_s'], '.1f')} "
                     f"| {_fmt(r['tau_mean'], '.2f')} | {_fmt(r['speedup_vs_hf'], '.2f', 'x')} "
                     f"| {_fmt(r['speedup_vs_ours_ar'], '.2f', 'x')} | {same_text} "
                     f"| {_fmt(r['ttft_ms_median'], '.1f')} | {r['generated_tokens']} | {r['prompts']} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | | |")
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    lines = ["| concurrency | system | prompts | generated tokens | wall s | tok/s | TPOT ms (mean) | tau "
             "| tok/s vs AR | same-as-AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['system']} | {r['prompts']} | {r['generated_tokens']} "
                     f"| {r['wall_s']:.2f} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['tpot_ms_mean'], '.2f')} "
                     f"| {_fmt(r['tau'], '.2f')} | {_fmt(r.get('speedup_vs_ar'), '.2f', 'x')} "
                     f"| {r['same_as_ar'] if r.get('same_as_ar') is not None else '-'} |")
    return "\n".join(lines)

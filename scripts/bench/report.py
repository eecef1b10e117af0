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

from eval.comparison import first_difference

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


def without_stop(ids: list[int], stop_ids=()) -> list[int]:
    """The generated ids without a final stop token: engines differ in whether they return the one that ended
    generation (ours and vLLM do)."""
    return list(ids[:-1]) if ids and ids[-1] in stop_ids else list(ids)


def compare_outputs(reference: list[dict], records: list[dict], stop_ids=()) -> dict:
    """Which shared prompts produced exactly the reference's token ids; the first differing position otherwise."""
    ref, mine = _by_index(reference), _by_index(records)
    common = [i for i in ref if i in mine]
    diffs = {i: first_difference(without_stop(ref[i]["token_ids"], stop_ids),
                                 without_stop(mine[i]["token_ids"], stop_ids)) for i in common}
    same = [i for i in common if diffs[i] is None]
    return {"compared": len(common), "identical": len(same),
            "fraction": len(same) / len(common) if common else None,
            "differing": [{"index": i, "first_diff": d} for i, d in diffs.items() if d is not None]}


def peak_gib(system: dict, throughput: list[dict], name: str) -> float | None:
    """The highest device memory seen while a system ran: its batch-1 run and its throughput runs."""
    peaks = [system.get("peak_gpu_memory_bytes")] + [r.get("peak_gpu_memory_bytes") for r in throughput
                                                     if r["system"] == name]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2**30 if peaks else None


def system_rows(systems: dict[str, dict], throughput: list[dict] = (), stop_ids=()) -> dict[str, dict]:
    """Each run system's summary plus speedups and the comparison with ours-ar (None where not applicable).
    tau is the acceptance length the system reports where it reports one over the run (vLLM's counters)."""
    rows = {}
    for name, system in systems.items():
        records = system["prompts"]
        row = dict(summarize(records))
        if system.get("tau_reported") is not None:
            row["tau_mean"] = system["tau_reported"]
        row["peak_gpu_memory_gib"] = peak_gib(system, throughput, name)
        for key, base in (("speedup_vs_hf", HF_BASELINE), ("speedup_vs_ours_ar", AR_BASELINE)):
            row[key] = tpot_speedup(systems[base]["prompts"], records) if base in systems else None
        row["same_as_ar"] = compare_outputs(systems[AR_BASELINE]["prompts"], records, stop_ids) \
            if AR_BASELINE in systems \
            else None
        rows[name] = row
    return rows


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def engine_of(system: str) -> str:
    return system.split("-")[0]  # ours, vllm, sglang


def compare_throughput(rows: list[dict], outputs: dict, order: list[str], concurrency: list[int],
                       stop_ids=()) -> list[dict]:
    """Adds to each throughput row its tokens/s over the same engine's AR run at the same concurrency and how
    many outputs equal ours-ar's there; returns the rows sorted by concurrency, then system order."""
    by_key = {(r["system"], r["concurrency"]): r for r in rows}
    for r in rows:
        ar = by_key.get((f"{engine_of(r['system'])}-ar", r["concurrency"]))
        if ar is not None and ar is not r and ar["tokens_per_s"] and r["tokens_per_s"]:
            r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
        reference, mine = outputs.get((AR_BASELINE, r["concurrency"])), outputs.get((r["system"], r["concurrency"]))
        if reference is not None and mine is not None and r["system"] != AR_BASELINE:
            same = sum(without_stop(a, stop_ids) == without_stop(b, stop_ids) for a, b in zip(mine, reference))
            r["same_as_ar"] = f"{same}/{len(reference)}"
    rank = {name: k for k, name in enumerate(order)}
    position = {c: k for k, c in enumerate(concurrency)}
    return sorted(rows, key=lambda r: (position.get(r["concurrency"], len(position)), rank.get(r["system"], len(rank))))


def latency_table(rows: dict[str, dict], skipped: dict[str, str]) -> str:
    lines = ["| system | TPOT ms | tok/s | tau | speedup vs HF | speedup vs ours-AR | same as ours-AR | TTFT ms "
             "| peak GPU GiB | generated tokens | prompts |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        same = r["same_as_ar"]
        same_text = "-" if same is None or not same["compared"] else f"{same['identical']}/{same['compared']}"
        lines.append(f"| {name} | {_fmt(r['tpot_ms_median'], '.2f')} | {_fmt(r['tokens_per_s'], '.1f')} "
                     f"| {_fmt(r['tau_mean'], '.2f')} | {_fmt(r['speedup_vs_hf'], '.2f', 'x')} "
                     f"| {_fmt(r['speedup_vs_ours_ar'], '.2f', 'x')} | {same_text} "
                     f"| {_fmt(r['ttft_ms_median'], '.1f')} | {_fmt(r.get('peak_gpu_memory_gib'), '.1f')} "
                     f"| {r['generated_tokens']} | {r['prompts']} |")
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | | | |")
    return "\n".join(lines)


def throughput_table(rows: list[dict]) -> str:
    lines = ["| concurrency | system | prompts | generated tokens | wall s | tok/s | TPOT ms (mean) | tau "
             "| tok/s vs own AR | same as ours-AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['system']} | {r['prompts']} | {r['generated_tokens']} "
                     f"| {r['wall_s']:.2f} | {_fmt(r['tokens_per_s'], '.1f')} | {_fmt(r['tpot_ms_mean'], '.2f')} "
                     f"| {_fmt(r['tau'], '.2f')} | {_fmt(r.get('speedup_vs_ar'), '.2f', 'x')} "
                     f"| {r['same_as_ar'] if r.get('same_as_ar') is not None else '-'} |")
    return "\n".join(lines)

"""The files of one evaluation: results.json, summary.md and acceptance_histogram.png."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from specdec.engine.metrics import Summary

log = logging.getLogger(__name__)


def write_json(path: Path, data: dict) -> None:
    # histogram keys are ints; json turns them into strings, which readers convert back
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8")


def _fmt(value, spec: str = ".3f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _run_rows(run: dict) -> list[tuple[str, str]]:
    s = run["summary"]
    rows = [
        (run["metric"], f"{run['accuracy']:.3f} ({run['correct']}/{run['problems']})"),
        ("requests failed", str(run["errors"])),
        ("answers cut off by max_new_tokens", str(run.get("cut_off", "-"))),
        ("generated tokens", str(s["generated_tokens"])),
        ("wall time (s)", f"{s['wall_time']:.2f}"),
        ("end-to-end tokens/s", f"{s['tokens_per_s']:.1f}"),
        ("TPOT (ms, mean over requests)", _fmt(s["tpot_s"], ".2f", 1000)),
        ("tau (mean of per-request means)", _fmt(s["tau_mean_of_requests"])),
        ("tau overall (committed / verify steps)", _fmt(s["tau_overall"])),
        ("verify steps", str(s["verify_steps"]) if s["verify_steps"] else "-"),
        ("tokens verified per step", _fmt(s.get("verified_per_step"), ".1f")),
        ("per-position acceptance", " ".join(f"{r:.2f}" for r in s["per_position_acceptance"]) or "-"),
    ]
    return rows


def summary_markdown(results: dict) -> str:
    """A Markdown page: the configuration line, one table of metrics, the baseline comparison."""
    config, main, base = results["config"], results["main"], results.get("baseline")
    lines = [f"# {config['problem_set']}: {config['target']}", "",
             f"drafter `{config['drafter'] or 'none'}`, {config['num_problems']} problems, "
             f"max_new_tokens {config['max_new_tokens']}, temperature {config['temperature']}, "
             f"concurrency {config['concurrency']}, KV {config['kv_cache_dtype']}, "
             f"{config['device_name']} ({config['dtype']}), grader {results['grader']['name']}", ""]
    header = ["metric", main["mode"]] + (["baseline (no drafter)"] if base else [])
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    base_rows = dict(_run_rows(base)) if base else {}
    for name, value in _run_rows(main):
        lines.append(f"| {name} | {value} |" + (f" {base_rows[name]} |" if base else ""))
    histogram = main["summary"]["histogram"]
    if histogram:
        lines += ["", "Acceptance-length histogram (length: verify steps): "
                  + ", ".join(f"{k}: {v}" for k, v in sorted(histogram.items()))]
    comparison = results.get("comparison")
    if comparison:
        lines += ["", f"Speedup (baseline TPOT / speculative TPOT): {_fmt(comparison['speedup_tpot'], '.2f')}x; "
                  f"tokens/s ratio {_fmt(comparison['speedup_tokens_per_s'], '.2f')}x.",
                  f"Identical outputs: {comparison['identical_fraction']:.3f}"]
        if comparison["differing"]:
            lines += ["", "| problem | id | first differing token | spec tokens | baseline tokens |",
                      "| --- | --- | --- | --- | --- |"]
            lines += [f"| {d['index']} | {d['id']} | {d['first_diff']} | {d['spec_tokens']} | {d['baseline_tokens']} |"
                      for d in comparison["differing"]]
    return "\n".join(lines) + "\n"


def write_histogram_png(path: Path, summary: Summary, block_size: int, title: str) -> bool:
    """Acceptance-length histogram and per-position acceptance; False (with a warning) when skipped."""
    if not summary.histogram:
        log.warning("no verify steps (no drafter): %s not written", path.name)
        return False
    try:
        from matplotlib.figure import Figure  # the Figure API needs no pyplot state or GUI backend
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[eval]'): %s not written", path.name)
        return False
    lengths = list(range(1, max(block_size, max(summary.histogram)) + 1))
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.bar(lengths, [summary.histogram.get(n, 0) for n in lengths], color="tab:blue")
    left.set(xlabel="acceptance length (tokens committed per verify step)", ylabel="verify steps",
             title=f"tau {summary.tau_mean_of_requests:.2f} (per-request mean), {summary.tau_overall:.2f} overall")
    left.set_xticks(lengths)
    positions = list(range(1, len(summary.per_position_acceptance) + 1))
    right.plot(positions, summary.per_position_acceptance, marker="o", color="tab:orange")
    right.set(xlabel="draft position k", ylabel="P(draft k accepted)", ylim=(-0.02, 1.02),
              title="per-position acceptance")
    if positions:
        right.set_xticks(positions)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return True

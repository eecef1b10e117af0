"""The Markdown report of `scripts/bench_serve.py`: servers side by side at each load level.

Two tables, rows grouped by level so that the servers measured at one level sit together: throughput
(with each server's output tokens/s over the first server's at that level, and the acceptance length
its /metrics reported) and latency (mean / median / p90 / p99 per metric).
"""

from __future__ import annotations

STATISTICS = ("mean", "median", "p90", "p99")
BUSY_CLIENT = 0.8  # share of one core the load generator used in a level, above which the report warns


def fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def spread(stats: dict, scale: float = 1.0, spec: str = ".1f") -> str:
    """'mean / median / p90 / p99' of one metric (None shown as -)."""
    return " / ".join(fmt(None if stats[k] is None else stats[k] * scale, spec) for k in STATISTICS)


def rows_by_level(result: dict) -> list[tuple[str, dict, dict]]:
    """(level label, server entry, level entry) for every measured level, levels in run order."""
    order: list[str] = []
    found: dict[str, list[tuple[dict, dict]]] = {}
    for server in result["servers"]:
        for level in server["levels"]:
            label = level["level"]["label"]
            if label not in found:
                order.append(label)
                found[label] = []
            found[label].append((server, level))
    return [(label, server, level) for label in order for server, level in found[label]]


def throughput_table(result: dict) -> str:
    rows = rows_by_level(result)
    first = result["servers"][0]["label"] if result["servers"] else None
    reference = {label: level["summary"]["output_throughput"] for label, server, level in rows
                 if server["label"] == first}
    lines = [f"| level | server | done | failed | unfinished | req/s | output tok/s | total tok/s | vs {first} "
             f"| tokens/chunk | acceptance length |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, server, level in rows:
        s = level["summary"]
        base = reference.get(label)
        ratio = s["output_throughput"] / base if base and s["output_throughput"] is not None else None
        lines.append(f"| {label} | {server['label']} | {s['completed']} | {s['failed']} | {s['unfinished']} "
                     f"| {fmt(s['request_throughput'], '.2f')} | {fmt(s['output_throughput'])} "
                     f"| {fmt(s['total_token_throughput'])} | {fmt(ratio, '.2f', 'x')} "
                     f"| {fmt(s['tokens_per_chunk'], '.2f')} | {fmt(s['acceptance_length'], '.2f')} |")
    return "\n".join(lines)


def latency_table(result: dict) -> str:
    # the server's and the engine's own times to first token (means, from /metrics): where the client's goes
    lines = ["| level | server | TTFT ms | TTFT in the server / the engine, mean ms | TPOT ms | ITL ms (per chunk) "
             "| ITL ms (per token) | E2E s |",
             "|---|---|---|---|---|---|---|---|"]
    for label, server, level in rows_by_level(result):
        s = level["summary"]
        own = f"{fmt(s.get('server_ttft_ms'), '.1f')} / {fmt(s.get('engine_ttft_ms'), '.1f')}"
        lines.append(f"| {label} | {server['label']} | {spread(s['ttft_ms'])} | {own} "
                     f"| {spread(s['tpot_ms'], spec='.2f')} "
                     f"| {spread(s['itl_ms'], spec='.2f')} | {spread(s['itl_per_token_ms'], spec='.2f')} "
                     f"| {spread(s['e2e_ms'], 1e-3, '.2f')} |")
    return "\n".join(lines)


def has_turns(result: dict) -> bool:
    return any("ttft_later_turns_ms" in level["summary"] for server in result["servers"] for level in server["levels"])


def turns_table(result: dict) -> str:
    """Conversations: TTFT of first and later turns, and how much of the later prompts was cached."""
    lines = ["| level | server | TTFT ms, turn 1 | TTFT ms, turns >= 2 | later turns | cached share of later prompts |",
             "|---|---|---|---|---|---|"]
    for label, server, level in rows_by_level(result):
        s = level["summary"]
        if "ttft_later_turns_ms" not in s:
            continue
        lines.append(f"| {label} | {server['label']} | {spread(s['ttft_first_turn_ms'])} "
                     f"| {spread(s['ttft_later_turns_ms'])} | {s['later_turns']} "
                     f"| {fmt(s['cached_share_later_turns'], '.0%')} |")
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    """Servers that failed, levels skipped, and the errors requests met."""
    lines = []
    for server in result["servers"]:
        if server.get("error"):
            lines.append(f"- {server['label']}: {server['error'].splitlines()[0]}")
        for label, why in server.get("skipped_levels", {}).items():
            lines.append(f"- {server['label']} {label}: skipped, {why}")
        for level in server["levels"]:
            where = f"{server['label']} {level['level']['label']}"
            for error, count in level["summary"]["errors"].items():
                lines.append(f"- {where}: {count} x {error}")
            busy = level["summary"].get("client_cpu_share")
            if busy is not None and busy > BUSY_CLIENT:
                lines.append(f"- {where}: the load generator used {busy:.0%} of a core; the numbers may be "
                             f"limited by the client")
    return lines


def system_copies(config: dict) -> str:
    repeat = config.get("system_repeat", 1)
    return f" (system prompt x{repeat})" if repeat > 1 else ""


def markdown(result: dict) -> str:
    config = result["config"]
    parts = [f"# Serving benchmark\n\n`{result['command_line']}`\n",
             f"dataset {config['dataset']}{system_copies(config)}, max_tokens {config['max_tokens']}, "
             f"temperature {config['temperature']}, "
             f"seed {config['seed']}, git {result['environment'].get('git_commit') or '-'}, "
             f"GPUs {', '.join(result['environment'].get('gpus') or []) or 'none'}\n",
             "## Throughput\n", throughput_table(result),
             "\n## Latency (mean / median / p90 / p99)\n", latency_table(result)]
    if has_turns(result):
        parts += ["\n## Conversations: first and later turns\n", turns_table(result)]
    extra = notes(result)
    if extra:
        parts += ["\n## Notes\n", "\n".join(extra)]
    return "\n".join(parts) + "\n"

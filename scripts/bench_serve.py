"""Load generator for OpenAI-compatible servers, in the spirit of `vllm bench serve`.

    python scripts/bench_serve.py (--base-url URL [--label NAME] | --serve [LABEL=]"SERVER ARGS" ...)
        [--model NAME] [--dataset math500|code|mixed|multiturn] [--system-repeat 1]
        [--concurrency 1,8,32,64 | --request-rate R[,R...] [--max-concurrency C]]
        [--num-prompts N] [--max-tokens 512] [--temperature 0] [--seed 0] [--ignore-eos]
        [--warmup-requests 4] [--warmup-tokens 16] [--request-timeout-s 600] [--time-limit-s 3600]
        [--server-start-timeout-s 900] [--server-stop-timeout-s 60] [--output FILE.json]

Target: a server already running at --base-url, or one launched per --serve entry as
`python -m specdec.serve SERVER ARGS --host 127.0.0.1 --port <free port>` (its log beside --output),
waited for on /health, measured, then stopped (SIGINT, then SIGTERM, then SIGKILL, each after a
bounded wait) before the next one starts, so that two servers never share the GPU. Entries are
labeled (`--serve dflash="--target X" --serve ar="--target X --no-drafter"`) and reported side by side.

Load, per level: --concurrency C (a list runs each in turn) keeps at most C requests in flight, the
next one sent as soon as one ends; --request-rate R sends requests at seeded Poisson arrivals
(`scripts/bench/arrivals.py`), at most --max-concurrency in flight when given. Each level sends
--num-prompts requests (default: max(32, 4 x C) at a concurrency; max(32, 10 x R, 4 x cap) at a
rate). Before the first level each server gets --warmup-requests short requests (--warmup-tokens
tokens each), not measured. Before each level the server is asked to empty its prefix cache (POST
/reset_prefix_cache, ours and vLLM's in its dev mode, else /flush_cache, SGLang's), so that every level
times its prompts as a fresh server would, not what an earlier level of the same prompts left cached; each
level records the endpoint that did it, or none (--keep-prefix-cache: not asked).

Prompts (`scripts/bench/chat_prompts.py`): math500 (eval/data, with the eval's instruction), code
(everyday coding requests, scripts/bench/code_requests.jsonl), mixed (both, equally) or multiturn
(conversations of 3-5 turns under a shared system prompt, each turn sent with the conversation so far
once the previous answer arrived; the level's concurrency and --num-prompts count conversations;
--system-repeat N sends N copies of the system prompt, ~500 tokens each). Every
server and level gets the same prompts in the same seeded order. Each request is one user turn through
/v1/chat/completions, its JSON body posted over httpx (as `vllm bench serve` posts it over aiohttp: the
official client's request preparation would count in every TTFT), streamed with usage included, no retries.
With conversations the report adds TTFT of first and later turns and the share of later turns' prompt
tokens the server reported cached (`usage.prompt_tokens_details.cached_tokens`).

Measured per request (`scripts/bench/chat_request.py`): TTFT (first content chunk), the gaps between
content chunks (ITL per chunk; a speculative server sends several tokens per chunk, so ITL per token
divides each gap by the request's tokens per chunk), TPOT = (e2e - TTFT) / (completion tokens - 1)
from the server's usage, e2e latency. Per server and level (`scripts/bench/latency_summary.py`):
requests/s, output and total tokens/s (also as a ratio to the first server's at the same level),
mean / median / p90 / p99 of each latency, failures, and, where the server's /metrics has them, its mean
acceptance length over the level and its mean time from a request's arrival in the engine to the first token
(`scripts/bench/server_metrics.py`).
The load generator's own CPU use per level is recorded too, with a warning when it nears one core.

Prints two Markdown tables and writes --output (default results/bench-serve-<date>.json: command line,
environment, configuration, per-level summaries and per-request records), rewritten after every level,
and the same tables in a .md file beside it. Bounds: requests per level, --request-timeout-s per
request, --time-limit-s for the whole run (starting servers and measuring; requests still running at
the limit are cancelled and counted as unfinished; stopping a launched server adds at most
--server-stop-timeout-s + 20 s). Exit status: 0, or 1 when a server failed or a level had no
successful request, 2 for bad arguments, 130 on Ctrl-C (after stopping the server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_serve.py`: the repo's packages and scripts.bench
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from scripts.bench import serving_report  # noqa: E402
from scripts.bench.server_metrics import (  # noqa: E402
    ACCEPTANCE_LENGTH, SERVER_TIME_TO_FIRST_TOKEN, TIME_TO_FIRST_TOKEN, mean_between, read_totals)
from scripts.bench.chat_prompts import DATASETS, ChatPrompt, load_prompts, take  # noqa: E402
from scripts.bench.chat_request import (  # noqa: E402
    SamplingSettings,
    send_chat_request,
    send_conversation,
    streaming_client,
)
from scripts.bench.host_environment import environment  # noqa: E402
from scripts.bench.latency_summary import summarize  # noqa: E402
from scripts.bench.load_generator import LoadLevel, run_level  # noqa: E402
from scripts.bench.server_process import HOST, ServerProcess  # noqa: E402

LABEL = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*)=(.*)", re.DOTALL)
CHOSEN_BY_THE_BENCHMARK = ("--host", "--port")


@dataclass(frozen=True)
class Target:
    label: str
    base_url: str | None = None  # a running server
    serve_args: str | None = None  # or the arguments of a server to launch


# ---- arguments -----------------------------------------------------------------------------------

def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be positive integers")
    return list(dict.fromkeys(values))


def rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise argparse.ArgumentTypeError("request rates must be positive and finite")
    return list(dict.fromkeys(values))


def serve_targets(entries: list[str]) -> list[Target]:
    """`[LABEL=]ARGS` entries as labeled targets; unlabeled ones are serve1, serve2, ..."""
    targets = []
    for number, entry in enumerate(entries, 1):
        match = LABEL.fullmatch(entry.strip())
        label, args_text = (match.group(1), match.group(2)) if match else (f"serve{number}", entry)
        try:
            tokens = shlex.split(args_text)
        except ValueError as err:
            raise ValueError(f"--serve {entry!r}: {err}") from None
        taken = [t for t in tokens if t.split("=", 1)[0] in CHOSEN_BY_THE_BENCHMARK]
        if taken:
            raise ValueError(f"--serve {entry!r}: {', '.join(taken)} is chosen by the benchmark ({HOST}, a free port)")
        targets.append(Target(label, serve_args=args_text))
    labels = [t.label for t in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--serve labels must differ, got {', '.join(labels)}")
    return targets


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--serve", action="append", metavar='[LABEL=]"ARGS"',
                        help="launch `python -m specdec.serve ARGS` (repeatable; run one after the other); "
                             "ARGS without a label or a space: --serve=ARGS")
    p.add_argument("--label", default="server", help="the --base-url server's name in the report")
    p.add_argument("--model", default=None, help="model name sent (default: the first of the server's /v1/models)")
    p.add_argument("--dataset", choices=DATASETS, default="math500")
    p.add_argument("--system-repeat", type=int, default=1,
                   help="multiturn: copies of the shared system prompt (long ones, as agents and retrieval send)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int_list, default=None,
                      help="requests in flight, a comma-separated list of levels (default 1,8,32,64)")
    load.add_argument("--request-rate", type=rate_list, default=None,
                      help="Poisson arrivals per second, a comma-separated list of levels")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: requests in flight at most")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level (default: see above)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="prompt order, arrival times, and per-request sampling seeds")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens (vLLM's extension)")
    p.add_argument("--warmup-requests", type=int, default=4, help="unmeasured requests before a server's first level")
    p.add_argument("--keep-prefix-cache", action="store_true",
                   help="levels find what earlier levels of the same prompts left in the server's prefix cache "
                        "(default: the server is asked to empty it before each level)")
    p.add_argument("--warmup-tokens", type=int, default=16)
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="one request's whole answer")
    p.add_argument("--time-limit-s", type=float, default=3600.0, help="the whole run (server starts included)")
    p.add_argument("--server-start-timeout-s", type=float, default=900.0,
                   help="a launched server's wait for /health (a first run converts the demo model)")
    p.add_argument("--server-stop-timeout-s", type=float, default=60.0, help="wait after SIGINT before SIGTERM")
    p.add_argument("--output", default=None, help="JSON file (default results/bench-serve-<date>.json)")
    args = p.parse_args(argv)
    if args.max_concurrency is not None and args.request_rate is None:
        p.error("--max-concurrency caps --request-rate levels; use --concurrency for a fixed concurrency")
    positive = {"--num-prompts": args.num_prompts, "--max-tokens": args.max_tokens,
                "--max-concurrency": args.max_concurrency, "--warmup-tokens": args.warmup_tokens}
    bad = [name for name, value in positive.items() if value is not None and value < 1]
    if args.system_repeat < 1:
        bad.append("--system-repeat")
    if args.system_repeat > 1 and args.dataset != "multiturn":
        p.error("--system-repeat lengthens the multiturn set's system prompt; add --dataset multiturn")
    if bad or args.warmup_requests < 0:
        p.error(f"{', '.join(bad) or '--warmup-requests'} must be positive (--warmup-requests may be 0)")
    if min(args.request_timeout_s, args.time_limit_s, args.server_start_timeout_s, args.server_stop_timeout_s) <= 0:
        p.error("timeouts and --time-limit-s must be positive")
    if args.temperature < 0:
        p.error("--temperature must not be negative")
    if args.base_url is not None and not re.fullmatch(r"https?://[^/\s]+/?", args.base_url):
        p.error(f"--base-url {args.base_url!r}: expected scheme://host:port, e.g. http://127.0.0.1:8000 (no /v1)")
    try:
        args.targets = serve_targets(args.serve) if args.serve else [Target(args.label, args.base_url.rstrip("/"))]
    except ValueError as err:
        p.error(str(err))
    return args


def load_levels(args) -> list[LoadLevel]:
    if args.request_rate is not None:
        cap = args.max_concurrency
        return [LoadLevel(args.num_prompts or max(32, math.ceil(10 * rate), 4 * (cap or 0)), cap, rate)
                for rate in args.request_rate]
    return [LoadLevel(args.num_prompts or max(32, 4 * c), c) for c in (args.concurrency or [1, 8, 32, 64])]


def serve_command(serve_args: str, port: int) -> list[str]:
    return [sys.executable, "-m", "specdec.serve", *shlex.split(serve_args), "--host", HOST, "--port", str(port)]


# ---- one server ----------------------------------------------------------------------------------

class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


async def served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("the server lists no model in /v1/models; pass --model")
    return models[0]["id"]


async def warm_up(client, model: str, prompts: list[ChatPrompt], args, deadline: Deadline) -> dict:
    """A few short requests at once; raises when every one fails (the levels would only repeat the error)."""
    if args.warmup_requests == 0:
        return {"requests": 0}
    sampling = SamplingSettings(args.warmup_tokens, args.temperature, args.seed)
    timeout = max(min(args.request_timeout_s, deadline.left()), 1.0)
    started = time.perf_counter()
    records = await asyncio.gather(*(send_chat_request(client, model, p, sampling, timeout)
                                     for p in take(prompts, args.warmup_requests)))
    if not any(r.ok for r in records):
        raise RuntimeError(f"every warm-up request failed, e.g. {records[0].error}")
    return {"requests": len(records), "failed": sum(not r.ok for r in records),
            "seconds": time.perf_counter() - started}


# a server's "empty your prefix cache" endpoints: ours (and vLLM's, in its dev mode), SGLang's
CACHE_RESETS = ("/reset_prefix_cache", "/flush_cache")


async def empty_prefix_cache(http: httpx.AsyncClient, base_url: str) -> str | None:
    """The endpoint that emptied the server's prefix cache, or None where none answered with success."""
    for path in CACHE_RESETS:
        try:
            answer = await http.post(base_url + path, timeout=60)
        except httpx.HTTPError:
            return None
        if answer.is_success:
            return path
    return None


async def measure_level(client, http: httpx.AsyncClient, base_url: str, model: str, prompts: list[ChatPrompt],
                        level: LoadLevel, args, deadline: Deadline) -> dict:
    def send(index: int, prompt: ChatPrompt):
        # per-request seeds: a sampled answer does not depend on which requests share its batch
        sampling = SamplingSettings(args.max_tokens, args.temperature, args.seed + index, args.ignore_eos)
        if prompt.follow_ups:  # a conversation: its turns one after the other, one record each
            return send_conversation(client, model, prompt, sampling, args.request_timeout_s)
        return send_chat_request(client, model, prompt, sampling, args.request_timeout_s)

    before = await read_totals(http, base_url)
    cpu_before = time.process_time()
    run = await run_level(send, take(prompts, level.num_prompts), level, args.seed, deadline.left())
    client_cpu_s = time.process_time() - cpu_before
    after = await read_totals(http, base_url)
    summary = summarize(run.records, run.duration_s)
    # near 1, the load generator's one event loop was saturated: the numbers may measure the client
    client_cpu_share = client_cpu_s / run.duration_s if run.duration_s > 0 else None
    mean_ms = lambda name: None if (s := mean_between(before, after, name)) is None else s * 1e3  # noqa: E731
    summary.update(unfinished=run.unfinished, acceptance_length=mean_between(before, after, ACCEPTANCE_LENGTH),
                   server_ttft_ms=mean_ms(SERVER_TIME_TO_FIRST_TOKEN), engine_ttft_ms=mean_ms(TIME_TO_FIRST_TOKEN),
                   client_cpu_share=client_cpu_share)
    return {"level": level.as_dict(), "summary": summary, "requests": [r.as_dict() for r in run.records]}


async def bench_server(entry: dict, base_url: str, prompts: list[ChatPrompt], levels: list[LoadLevel], args,
                       deadline: Deadline, save) -> None:
    """Warm up, then every level in turn, saving after each; fills `entry`."""
    # trust_env=False: no proxy from the environment; requests go to base_url and nowhere else
    async with httpx.AsyncClient(trust_env=False) as http, \
            streaming_client(base_url, args.request_timeout_s) as client:
        model = entry["model"] = args.model or await served_model(client)
        entry["warmup"] = await warm_up(client, model, prompts, args, deadline)
        for level in levels:
            if deadline.left() <= 0:
                entry["skipped_levels"][level.label] = "--time-limit-s reached"
                continue
            log(f"[{entry['label']}] {level.label}: {level.num_prompts} requests")
            reset = None if args.keep_prefix_cache else await empty_prefix_cache(http, base_url)
            measured = await measure_level(client, http, base_url, model, prompts, level, args, deadline)
            measured["prefix_cache_reset"] = reset
            entry["levels"].append(measured)
            s = measured["summary"]
            log(f"[{entry['label']}] {level.label}: {s['completed']} done, {s['failed']} failed, "
                f"{s['unfinished']} unfinished in {s['duration_s']:.1f} s, "
                f"{s['output_throughput'] or 0:.1f} output tok/s")
            save()


def bench_target(target: Target, entry: dict, prompts, levels, args, deadline: Deadline, out: Path, save) -> None:
    if target.serve_args is None:
        asyncio.run(bench_server(entry, target.base_url, prompts, levels, args, deadline, save))
        return
    server = ServerProcess(lambda port: serve_command(target.serve_args, port), log_path(out, target.label),
                           args.server_stop_timeout_s)
    entry.update(base_url=server.base_url, launch_command=shlex.join(server.command), log=str(server.log_path))
    log(f"[{target.label}] starting: {shlex.join(server.command)} (log: {server.log_path})")
    try:
        server.start()
        entry["startup_s"] = server.wait_until_healthy(max(min(args.server_start_timeout_s, deadline.left()), 1.0))
        log(f"[{target.label}] healthy after {entry['startup_s']:.1f} s")
        asyncio.run(bench_server(entry, server.base_url, prompts, levels, args, deadline, save))
    finally:
        entry["exit_status"] = server.stop()
        log(f"[{target.label}] stopped (exit status {entry['exit_status']})")


# ---- the run -------------------------------------------------------------------------------------

def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def log_path(out: Path, label: str) -> Path:
    return out.with_name(f"{out.stem}.{label}.log")


def server_entry(target: Target) -> dict:
    return {"label": target.label, "base_url": target.base_url, "serve_args": target.serve_args,
            "launch_command": None, "log": None, "model": None, "startup_s": None, "warmup": None,
            "levels": [], "skipped_levels": {}, "error": None, "exit_status": None}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    deadline = Deadline(args.time_limit_s)
    prompts = load_prompts(args.dataset, args.seed, args.system_repeat)
    levels = load_levels(args)
    out = Path(args.output or f"results/bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command_line": shlex.join([Path(sys.executable).name, "scripts/bench_serve.py", *argv]),
        "environment": environment(),
        "config": {"dataset": args.dataset, "system_repeat": args.system_repeat, "prompts_in_dataset": len(prompts),
                   "levels": [level.as_dict() for level in levels],
                   "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
                   "ignore_eos": args.ignore_eos, "model": args.model, "warmup_requests": args.warmup_requests,
                   "warmup_tokens": args.warmup_tokens, "request_timeout_s": args.request_timeout_s,
                   "time_limit_s": args.time_limit_s, "endpoint": "/v1/chat/completions (streamed, usage included)"},
        "servers": [],
    }

    def save() -> None:
        out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        out.with_suffix(".md").write_text(serving_report.markdown(result), encoding="utf-8")

    status = 0
    for target in args.targets:
        entry = server_entry(target)
        result["servers"].append(entry)
        if deadline.left() <= 0:
            entry["error"] = "--time-limit-s reached before this server's turn"
            status = 1
            continue
        try:
            bench_target(target, entry, prompts, levels, args, deadline, out, save)
        except KeyboardInterrupt:
            entry["error"] = "interrupted"
            save()
            log(f"interrupted; what was measured is in {out}")
            return 130
        except Exception as err:  # one server failing (ServerStartError included) must not lose the others' numbers
            entry["error"] = f"{type(err).__name__}: {err}"
            log(f"[{target.label}] failed: {entry['error']}")
        if entry["error"] or any(level["summary"]["completed"] == 0 for level in entry["levels"]):
            status = 1
        save()

    print("\n## Throughput\n")
    print(serving_report.throughput_table(result))
    print("\n## Latency (mean / median / p90 / p99)\n")
    print(serving_report.latency_table(result))
    if serving_report.has_turns(result):
        print("\n## Conversations: first and later turns\n")
        print(serving_report.turns_table(result))
    extra = serving_report.notes(result)
    if extra:
        print("\n" + "\n".join(extra))
    print(f"\nJSON: {out}, Markdown: {out.with_suffix('.md')}")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Peer serving engines in `scripts/bench_peers.py`: vLLM and SGLang, with and without DFlash.

Each peer system runs `scripts/bench/peer_worker.py` in a process of its own, with only the peer's
site directory on PYTHONPATH (`--peer-site vllm=DIR,sglang=DIR`; `scripts/peers/` builds those
directories from pinned wheels), on the same prompt token ids, max new tokens, stop tokens and GPU
as ours, with our drafter rewritten in the bf16 z-lab format both peers read. The worker does the
batch-1 prompts and the throughput runs in one engine start; this side writes the job, bounds the
process in time, samples the GPU's peak memory and turns the worker's result into the runner's shapes.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scripts.bench.gpu_memory import PeakGpuMemory

WORKER = Path(__file__).resolve().with_name("peer_worker.py")
PEER_SYSTEMS = {"vllm-dflash": ("vllm", True), "vllm-ar": ("vllm", False),
                "sglang-dflash": ("sglang", True), "sglang-ar": ("sglang", False)}
GPU_MEMORY_UTILIZATION = 0.9  # the same fraction ours sizes its KV pool from
TAIL_LINES = 200
ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")


def parse_sites(text: str) -> dict[str, str]:
    """"vllm=/tmp/peers/vllm,sglang=/tmp/peers/sglang" -> {engine: directory}."""
    sites = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        engine, sep, directory = item.partition("=")
        if not sep or engine not in {e for e, _ in PEER_SYSTEMS.values()} or not directory:
            raise ValueError(f"--peer-site expects ENGINE=DIR items with ENGINE vllm or sglang, got {item!r}")
        sites[engine] = directory
    return sites


def peer_environment(site: str | None) -> dict[str, str]:
    """This process's environment with PYTHONPATH replaced by the peer's site directory: our flashinfer and
    the repo must not shadow the versions the peer pins."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_")}
    env.pop("PYTHONPATH", None)
    if site:
        env["PYTHONPATH"] = site
    # offline, no usage reporting: the GPU machine has no network, and a lookup would only time out
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1")
    return env


def why_skip_peer(engine: str, site: str | None) -> str | None:
    """None when the peer's package can be found with its site directory, else why not."""
    if site is not None and not Path(site).is_dir():
        return f"{engine}: site directory {site} does not exist (install it: scripts/peers/README.md)"
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({engine!r}) is None)"
    found = subprocess.run([sys.executable, "-c", probe], env=peer_environment(site), capture_output=True,
                           timeout=60).returncode == 0
    if not found:
        where = f"in {site}" if site else "in this Python (no --peer-site given)"
        return f"{engine} is not importable {where}; scripts/peers/README.md installs it"
    return None


def run_worker(command: list[str], env: dict, timeout_s: float) -> tuple[int | str, list[str]]:
    """Runs the worker, echoing its output here (progress shows in the benchmark's log) and keeping the last
    lines: a peer that dies in a subprocess of its own (SGLang's scheduler) leaves its reason only there."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")

    def pump():
        for line in proc.stdout:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = f"killed after {timeout_s:.0f} s"
    reader.join(timeout=10)
    if not reader.is_alive():  # else a peer's leftover subprocess still holds the pipe: closing it under the reader
        proc.stdout.close()   # would raise in its thread
    return rc, list(tail)


def last_error(lines: list[str]) -> str:
    """The last line that names an exception (e.g. "ValueError: ..."), else the last line."""
    errors = [line.strip() for line in lines if ERROR_LINE.search(line)]
    return (errors or [line.strip() for line in lines if line.strip()] or ["no output"])[-1]


def build_job(ctx, name: str, prompts, warm_prompt, batch, budget_s) -> dict:
    engine, speculative = PEER_SYSTEMS[name]
    args = ctx.args
    longest = max(len(p) for p in [*prompts, warm_prompt, *batch])
    return {"engine": engine, "model": str(ctx.target_dir),
            "drafter": str(ctx.peer_drafter_dir()) if speculative else None,
            "block_size": ctx.block_size, "prompts": prompts, "warm_prompt": warm_prompt, "batch": batch,
            "max_new_tokens": args.max_new_tokens, "warmup_tokens": args.warmup_tokens,
            "stop_token_ids": ctx.eos_ids, "concurrency": list(args.concurrency),
            "max_num_seqs": max([1, *args.concurrency]), "max_model_len": longest + args.max_new_tokens + 64,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "budget_s": budget_s}


def run_peer(ctx, name: str, problems, prompts, warm_prompt, batch, budget_s: float | None, timeout_s: float,
             outputs: dict) -> tuple[dict, list[dict], dict]:
    """(the system's batch-1 entry, its throughput rows, {"C": why skipped}); fills outputs[(name, C)] with the
    throughput runs' token ids. Raises when the worker produced nothing usable."""
    engine, _ = PEER_SYSTEMS[name]
    entered = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(build_job(ctx, name, prompts, warm_prompt, batch, budget_s)), encoding="utf-8")
        with PeakGpuMemory() as memory:
            rc, tail = run_worker([sys.executable, str(WORKER), str(job_path), str(result_path)],
                                  peer_environment(ctx.peer_sites.get(engine)), timeout_s)
        if not result_path.exists():
            raise RuntimeError(f"{name}: the worker wrote no result (exit {rc}); {last_error(tail)}")
        result = json.loads(result_path.read_text(encoding="utf-8"))
    if result["error"] and not result["prompts"]:
        raise RuntimeError(f"{name}: {result['error']}")
    records = [{**r, "id": problems[r["index"]].id} for r in result["prompts"]]
    entry = {"info": {**(result["info"] or {}), "exit": rc, "error": result["error"]}, "prompts": records,
             "truncated": len(records) < len(prompts), "budget_s": budget_s,
             "seconds": time.perf_counter() - entered, "tau_reported": result["tau_reported"],
             "peak_gpu_memory_bytes": memory.peak_bytes}
    rows = []
    for row in result["throughput"]:
        outputs[(name, row["concurrency"])] = row.pop("token_ids")
        rows.append({**row, "system": name, "peak_gpu_memory_bytes": memory.peak_bytes})
    return entry, rows, result["throughput_skipped"]

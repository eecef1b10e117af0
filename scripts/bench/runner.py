"""Running the systems of `scripts/bench_peers.py`: what they are built from, the time budgets, the
batch-1 loop of one system and the throughput runs of ours.

Time budgets (so that one bounded device call always ends with a report):
- --system-budget-s: a system stops taking new prompts when the next one (at its mean wall time so
  far) would end past this many seconds since the system started building; at least one prompt runs.
- --deadline-s: the whole run's wall-clock budget. Each system's budget is then also at most its
  share of what is left, after a reserve for the throughput runs (THROUGHPUT_SHARE of the deadline);
  throughput runs go from the highest concurrency down and one whose estimate (from the batch-1
  wall times) does not fit in what is left is skipped with a note.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from eval import command as eval_command
from scripts.bench.gpu_memory import PeakGpuMemory
from scripts.bench.host_environment import environment as host_environment
from scripts.bench.peers import PEER_SYSTEMS, why_skip_peer
from scripts.bench.systems import (HFSystem, OursSystem, ZLabSystem, convert_drafter_for_zlab, dflash_import_error,
                                   drafter_directory, load_hf_model)

SYSTEMS = ("ours-dflash-bf16", "ours-dflash-auto", "ours-dflash-fp8", "ours-ar", "ours-ar-overlapped", *PEER_SYSTEMS,
           "hf-generate", "hf-assisted", "zlab-dflash")
DRAFTER_SYSTEMS = {"ours-dflash-bf16", "ours-dflash-auto", "ours-dflash-fp8", "zlab-dflash",
                   *(name for name, (_, speculative) in PEER_SYSTEMS.items() if speculative)}
HF_TARGET_SYSTEMS = ("hf-generate", "hf-assisted", "zlab-dflash")  # share one HF copy of the target
THROUGHPUT_SHARE = 0.3  # of --deadline-s, kept for the throughput runs
BUILD_ALLOWANCE_S = 15.0  # model load + warm-up of one throughput run, added to its estimate


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def release_memory(device: torch.device) -> None:
    eval_command.release_memory(device.type == "cuda")


def environment(device: torch.device) -> dict:
    """The host's (scripts.bench.host_environment) plus the device the systems run on, and the versions the
    reports name at the top level."""
    env = host_environment(extra_packages=("dflash",))
    versions = env["versions"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({env['cpu']})"
    return {**env, "device": str(device), "device_name": name, "torch": versions["torch"],
            "transformers": versions["transformers"], "flashinfer": versions["flashinfer-python"],
            "dflash": versions["dflash"]}


class Clock:
    def __init__(self, deadline_s: float = 0.0, system_budget_s: float = 0.0, reserve_throughput: bool = False):
        self.start = time.perf_counter()
        self.deadline_s, self.system_budget_s = deadline_s or None, system_budget_s or None
        self.reserve_s = THROUGHPUT_SHARE * deadline_s if deadline_s and reserve_throughput else 0.0

    def remaining(self) -> float | None:
        return None if self.deadline_s is None else self.deadline_s - (time.perf_counter() - self.start)

    def system_budget(self, systems_left: int) -> float | None:
        budgets = [self.system_budget_s] if self.system_budget_s else []
        remaining = self.remaining()
        if remaining is not None:
            budgets.append(max(0.0, remaining - self.reserve_s) / max(systems_left, 1))
        return min(budgets) if budgets else None

    def fits(self, estimate_s: float | None) -> bool:
        remaining = self.remaining()
        return remaining is None or estimate_s is None or estimate_s <= remaining


class Context:
    """Target, tokenizer, stop tokens, drafter and dtypes shared by every system."""

    def __init__(self, args, device: torch.device):
        from transformers import AutoTokenizer

        from specdec.weights.demo_models import resolve_model
        from specdec.models.loader import eos_token_ids

        self.args, self.device = args, device
        self.target_dir = resolve_model(args.target)
        self.tokenizer = AutoTokenizer.from_pretrained(self.target_dir)
        self.eos_ids = sorted(eos_token_ids(self.target_dir, self.tokenizer))
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.hf_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.drafter_dir, self.drafter_problem = None, None
        name = args.drafter
        if name is None:
            from drafters import DEFAULT_DRAFTERS

            name = DEFAULT_DRAFTERS.get(args.target) or DEFAULT_DRAFTERS.get(Path(str(args.target)).name)
        if name is None:
            self.drafter_problem = f"no --drafter given and {args.target} has no shipped default drafter"
        else:
            try:
                self.drafter_dir = drafter_directory(name)
            except FileNotFoundError as err:
                self.drafter_problem = str(err)
        # converted up front (a demo GGUF's first use takes a minute), so that no system's budget pays for it
        self.assistant_dir, self.assistant_problem = None, None
        if "hf-assisted" in args.systems:
            try:
                self.assistant_dir = resolve_model(args.assistant)
            except Exception as err:  # unknown name, or a demo model that cannot be fetched here
                self.assistant_problem = f"assistant {args.assistant}: {type(err).__name__}: {err}"
        self.hf_target = None
        self.peer_sites = args.peer_site
        self._peer_problems: dict[str, str | None] = {}
        self._peer_drafter = None

    @property
    def block_size(self) -> int | None:
        if self.drafter_dir is None:
            return None
        config = json.loads((Path(self.drafter_dir) / "config.json").read_text(encoding="utf-8"))
        return int((config.get("dflash_config") or {}).get("block_size") or config["block_size"])

    def peer_drafter_dir(self) -> Path:
        """Our drafter rewritten once in plain bf16 weights (the z-lab format vLLM and SGLang read)."""
        if self._peer_drafter is None:
            self._peer_drafter = tempfile.TemporaryDirectory(prefix="peer-drafter-")
            convert_drafter_for_zlab(self.drafter_dir, self._peer_drafter.name, self.device, torch.bfloat16)
            release_memory(self.device)
        return Path(self._peer_drafter.name)

    def shared_hf_target(self):
        if self.hf_target is None:
            self.hf_target = load_hf_model(self.target_dir, self.device, self.hf_dtype, self.eos_ids, self.pad_id)
        return self.hf_target

    def why_skip(self, name: str) -> str | None:
        if name in DRAFTER_SYSTEMS and self.drafter_dir is None:
            return self.drafter_problem
        if name == "hf-assisted" and self.assistant_dir is None:
            return self.assistant_problem
        if name == "zlab-dflash":
            return dflash_import_error()
        if name in PEER_SYSTEMS:
            engine = PEER_SYSTEMS[name][0]
            if engine not in self._peer_problems:
                self._peer_problems[engine] = why_skip_peer(engine, self.peer_sites.get(engine))
            return self._peer_problems[engine]
        return None

    def ours(self, drafter: bool, kv_cache_dtype: str = "auto", max_num_seqs: int = 1,
             overlap_steps: bool = True, verify: str = "chain") -> OursSystem:
        return OursSystem(str(self.target_dir), str(self.drafter_dir) if drafter else None, device=str(self.device),
                          kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
                          num_kv_pages=self.args.num_kv_pages, overlap_steps=overlap_steps, verify=verify)

    def build(self, name: str):
        hf = dict(device=self.device, dtype=self.hf_dtype, eos_ids=self.eos_ids, pad_id=self.pad_id)
        if name == "ours-dflash-bf16":
            return self.ours(drafter=True)
        if name == "ours-dflash-auto":
            return self.ours(drafter=True, verify="auto")
        if name == "ours-dflash-fp8":
            return self.ours(drafter=True, kv_cache_dtype="fp8")
        if name == "ours-ar":
            return self.ours(drafter=False, overlap_steps=False)
        if name == "ours-ar-overlapped":
            return self.ours(drafter=False)
        if name == "hf-generate":
            return HFSystem(self.target_dir, target_model=self.shared_hf_target(), **hf)
        if name == "hf-assisted":
            return HFSystem(self.target_dir, assistant_dir=self.assistant_dir, target_model=self.shared_hf_target(),
                            **hf)
        if name == "zlab-dflash":
            return ZLabSystem(self.target_dir, self.drafter_dir, target_model=self.shared_hf_target(), **hf)
        raise ValueError(f"unknown system {name!r}")


def run_system(ctx: Context, name: str, problems, prompts, warm_prompt, budget_s: float | None) -> dict:
    """Build, warm up once, then time the prompts in order until done or the next would overrun budget_s."""
    entered = time.perf_counter()
    with PeakGpuMemory() as memory:
        system = ctx.build(name)
        try:
            info, records = system.info(), time_prompts(ctx, name, system, problems, prompts, warm_prompt,
                                                        entered, budget_s)
        finally:
            system.close()
            del system
    return {"info": info, "prompts": records, "truncated": len(records) < len(prompts), "budget_s": budget_s,
            "seconds": time.perf_counter() - entered, "peak_gpu_memory_bytes": memory.peak_bytes}


def time_prompts(ctx: Context, name: str, system, problems, prompts, warm_prompt, entered: float,
                 budget_s: float | None) -> list[dict]:
    args = ctx.args
    system.generate(warm_prompt, args.warmup_tokens)
    records = []
    for i, (problem, ids) in enumerate(zip(problems, prompts)):
        if budget_s is not None and records:
            per_prompt = statistics.fmean(r["wall_s"] for r in records)
            if time.perf_counter() - entered + per_prompt > budget_s:
                log(f"[{name}] time budget ({budget_s:.0f} s) reached after {len(records)} prompt(s)")
                break
        sample = system.generate(ids, args.max_new_tokens)
        records.append({"index": i, "id": problem.id, **sample.as_dict()})
        tpot = f"{sample.tpot_s * 1e3:.2f} ms" if sample.tpot_s else "-"
        log(f"[{name}] {i + 1}/{len(prompts)}: {sample.generated_tokens} tokens, TPOT {tpot}, "
            f"wall {sample.wall_s:.2f} s")
    return records


def throughput_prompts(prompts: list[list[int]], minimum: int) -> list[list[int]]:
    """The subset repeated (cycled) up to max(minimum, len(prompts)) prompts."""
    return list(itertools.islice(itertools.cycle(prompts), max(minimum, len(prompts))))


def estimate_run_s(batch1: dict | None, count: int, concurrency: int) -> float | None:
    """A deliberately high guess at one throughput run's seconds, from the same system's batch-1 wall times:
    count prompts at the mean batch-1 wall time, `concurrency` at a time, each step up to (1 + C/16) x slower."""
    if not batch1 or not batch1["prompts"]:
        return None
    per_prompt = statistics.fmean(r["wall_s"] for r in batch1["prompts"])
    return BUILD_ALLOWANCE_S + count * per_prompt / concurrency * (1 + concurrency / 16)


def run_throughput(ctx: Context, batch, warm_prompt, clock: Clock, batch1: dict[str, dict], outputs: dict,
                   on_row) -> tuple:
    """Ours, all prompts submitted at once with max_num_seqs=C, from the highest C down: the chosen DFlash systems
    (bf16 KV), AR in order (always: the outputs' reference) and AR with overlapped steps if chosen.
    Fills outputs[(system, C)] with the token ids; returns (rows, {"C/system": why skipped})."""
    args = ctx.args
    dflash = [name for name in ("ours-dflash-bf16", "ours-dflash-auto")
              if name in args.systems and ctx.drafter_dir is not None]
    variants = ([(name, True) for name in dflash] + [("ours-ar", False)]
                + ([("ours-ar-overlapped", False)] if "ours-ar-overlapped" in args.systems else []))
    rows, skipped = [], {}
    for concurrency in sorted(set(args.concurrency), reverse=True):
        for name, drafter in variants:
            estimate = estimate_run_s(batch1.get(name), len(batch), concurrency)
            if not clock.fits(estimate):
                skipped[f"C={concurrency} {name}"] = (f"estimated {estimate:.0f} s, only {clock.remaining():.0f} s "
                                                      f"left of --deadline-s")
                log(f"[throughput C={concurrency}] {name} skipped: {skipped[f'C={concurrency} {name}']}")
                continue
            with PeakGpuMemory() as memory:
                system = ctx.ours(drafter=drafter, max_num_seqs=concurrency,
                                  overlap_steps=name != "ours-ar",
                                  verify="auto" if name == "ours-dflash-auto" else "chain")
                try:
                    system.generate_many([warm_prompt] * min(concurrency, len(batch)), args.warmup_tokens)
                    results, summary, wall = system.generate_many(batch, args.max_new_tokens)
                finally:
                    system.close()
                    del system
                    release_memory(ctx.device)
            outputs[(name, concurrency)] = [r.token_ids for r in results]
            row = {"concurrency": concurrency, "system": name, "prompts": len(batch),
                   "generated_tokens": summary.generated_tokens, "wall_s": wall,
                   "tokens_per_s": summary.generated_tokens / wall if wall > 0 else None,
                   "tpot_ms_mean": None if summary.tpot_s is None else summary.tpot_s * 1e3,
                   "tau": summary.tau_mean_of_requests, "tau_overall": summary.tau_overall,
                   "verify_steps": summary.verify_steps, "estimate_s": estimate,
                   "peak_gpu_memory_bytes": memory.peak_bytes,
                   "per_request": [{"generated_tokens": r.stats.generated_tokens, "tpot_s": r.stats.tpot,
                                    "ttft_s": r.stats.ttft} for r in results]}
            rows.append(row)
            log(f"[throughput C={concurrency}] {name}: {row['generated_tokens']} tokens in {wall:.2f} s, "
                f"{row['tokens_per_s']:.1f} tok/s")
            on_row(rows, skipped)
    return rows, skipped

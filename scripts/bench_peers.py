"""Side-by-side benchmark against peer systems on the same math500 prompts, plus our throughput.

    python scripts/bench_peers.py [--data FILE.jsonl] [--limit 20] [--seed 0]
        [--max-new-tokens 512] [--target qwen2.5-coder-1.5b-instruct] [--drafter NAME|DIR]
        [--assistant qwen2.5-coder-0.5b-instruct] [--systems ours-ar,hf-generate,...]
        [--concurrency 1,8,32] [--throughput-prompts 32] [--device auto|cpu|cuda]
        [--num-kv-pages N] [--warmup-tokens 32] [--system-budget-s S] [--deadline-s S]
        [--peer-site vllm=DIR,sglang=DIR] [--peer-timeout-s 900] [--out FILE.json]

Batch 1, greedy, the same prompt token ids (math500 subset, z-lab prompt, the target's chat
template: `eval.problems`) and the same stop tokens (the engine's EOS ids) for every system:

    ours-dflash-bf16  specdec.LLM(target, drafter, verify="chain"), bf16 KV cache (the model dtype), max_num_seqs=1,
                      each step's next draft queued ahead (overlap_steps, the default)
    ours-dflash-auto  the same with verify="auto" (the default policy: chain length or tree per step)
    ours-dflash-fp8   ours-dflash-bf16 with kv_cache_dtype="fp8"
    ours-ar           specdec.LLM(target) without a drafter, steps in order (overlap_steps=False)
    ours-ar-overlapped  the same with overlap_steps=True, the default
    vllm-dflash       vLLM (AsyncLLM) with our drafter, method "dflash", block_size - 1 speculative tokens
    vllm-ar           vLLM without speculation
    sglang-dflash     SGLang (Engine) with our drafter, algorithm DFLASH
    sglang-ar         SGLang without speculation
    hf-generate       transformers generate (sdpa; bf16 on CUDA, fp32 on CPU)
    hf-assisted       transformers assisted generation, --assistant as assistant_model
    zlab-dflash       z-lab's `dflash` package: DFlashDraftModel.spec_generate with the HF target and
                      our drafter rewritten in plain weights (skipped when `dflash` is not importable)

Peers run in a process of their own each, from their own site directory (--peer-site; built from
pinned wheels by scripts/peers/), on the same GPU; they are skipped with a note when not importable
(scripts/bench/peers.py, scripts/bench/peer_worker.py says how they are timed).

Each system gets one warm-up call (a math500 problem outside the subset, --warmup-tokens new
tokens) before its timed prompts; GPU memory is released between systems. TPOT excludes the
prefill (how each system is timed: scripts/bench/systems.py). Reported per system: median TPOT,
end-to-end tokens/s, tau, speedups over hf-generate and ours-ar (TPOT ratios on shared prompts),
the fraction of prompts whose output token ids equal ours-ar's (whose KV cache is in the model
dtype: for ours-dflash-fp8 a difference may come from the fp8 cache as well as from bf16 near-ties).

Throughput (ours: the chosen DFlash systems with bf16 KV, AR in order and AR overlapped if chosen; each
peer that ran): for each --concurrency C, the subset
repeated to at least --throughput-prompts prompts, at most C requests in flight (ours: max_num_seqs=C;
peers: C concurrent streams on one engine): generated tokens / wall seconds, the mean per-request
TPOT, tokens/s over the same engine's AR, outputs equal to ours-ar's at that C. Peak GPU memory:
device-wide through NVML while a system ran (scripts/bench/gpu_memory.py).

Prints both Markdown tables and writes the raw JSON (device, versions, command line, per-prompt
numbers and token ids) to --out (default results/bench-peers-<date>.json), rewritten after every
system so that an interrupted run keeps what it measured. --deadline-s bounds the whole run (one
device call): systems then stop early and throughput runs that would not fit are skipped, each
with a note (scripts/bench/runner.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_peers.py`: the repo's packages and scripts.bench
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench import report  # noqa: E402
from scripts.bench.peers import PEER_SYSTEMS, parse_sites, run_peer  # noqa: E402
from scripts.bench.runner import (HF_TARGET_SYSTEMS, SYSTEMS, Clock, Context, environment, log,  # noqa: E402
                                  release_memory, run_system, run_throughput, throughput_prompts)

from specdec.weights.demo_models import DEFAULT_DRAFT as DEFAULT_ASSISTANT  # noqa: E402
from specdec.weights.demo_models import DEFAULT_TARGET  # noqa: E402


def _int_list(text: str) -> list[int]:
    if text.strip().lower() in ("", "none", "0"):
        return []
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be positive")
    return list(dict.fromkeys(values))


def _systems(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    return [s for s in SYSTEMS if s in names]  # fixed order


def _sites(text: str) -> dict[str, str]:
    try:
        return parse_sites(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=None, help="math500 jsonl (default: the copy shipped in eval/data)")
    p.add_argument("--limit", type=int, default=20, help="seeded random subset size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo model name or HF model directory")
    p.add_argument("--drafter", default=None, help="DFlash drafter: shipped name or directory "
                                                   "(default: the target's shipped drafter)")
    p.add_argument("--assistant", default=DEFAULT_ASSISTANT, help="assistant model of hf-assisted (same tokenizer)")
    p.add_argument("--systems", type=_systems, default=list(SYSTEMS), help=f"comma-separated: {','.join(SYSTEMS)}")
    p.add_argument("--concurrency", type=_int_list, default=[1, 8, 32, 64],
                   help="throughput runs of ours (max_num_seqs values); 'none' skips them")
    p.add_argument("--throughput-prompts", type=int, default=64,
                   help="the subset is repeated until at least this many prompts are submitted")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size of ours (default: from memory)")
    p.add_argument("--warmup-tokens", type=int, default=32, help="new tokens of each system's untimed warm-up call")
    p.add_argument("--system-budget-s", type=float, default=0.0,
                   help="seconds per system (build included) before it stops taking prompts; 0: no limit")
    p.add_argument("--deadline-s", type=float, default=0.0, help="wall-clock budget of the whole run; 0: no limit")
    p.add_argument("--peer-site", type=_sites, default={},
                   help="site directories of the peers, e.g. vllm=/tmp/peers/vllm,sglang=/tmp/peers/sglang "
                        "(default: import them from this Python)")
    p.add_argument("--peer-timeout-s", type=float, default=900.0,
                   help="a peer's process (engine start, batch 1 and throughput) is killed after this long")
    p.add_argument("--out", default=None, help="JSON file (default results/bench-peers-<date>.json)")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 2 or args.warmup_tokens < 1 or args.throughput_prompts < 1:
        p.error("--limit, --warmup-tokens and --throughput-prompts must be positive, --max-new-tokens at least 2")
    if args.system_budget_s < 0 or args.deadline_s < 0:
        p.error("--system-budget-s and --deadline-s must not be negative")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available")
    return device


def build_prompts(args, tokenizer):
    """The seeded subset's prompt ids, and a warm-up prompt from a problem outside it (the first one if none)."""
    from eval.problems import load_problems, prompt_ids, select

    problems = load_problems(args.data)
    chosen = select(problems, args.limit, args.seed)
    taken = {p.index for p in chosen}
    warm = next((p for p in problems if p.index not in taken), chosen[0])
    return chosen, [prompt_ids(tokenizer, p.problem) for p in chosen], prompt_ids(tokenizer, warm.problem)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clock = Clock(args.deadline_s, args.system_budget_s, reserve_throughput=bool(args.concurrency))
    device = resolve_device(args.device)
    ctx = Context(args, device)
    problems, prompts, warm_prompt = build_prompts(args, ctx.tokenizer)
    log(f"{len(prompts)} prompt(s) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"max {args.max_new_tokens} new tokens, device {device}, stop tokens {ctx.eos_ids}")
    out = Path(args.out or f"results/bench-peers-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    systems, skipped = {}, {}
    result = {
        "command_line": shlex.join([Path(sys.executable).name, "scripts/bench_peers.py", *argv]),
        "environment": environment(device),
        "config": {"target": args.target, "target_dir": str(ctx.target_dir),
                   "drafter": None if ctx.drafter_dir is None else str(ctx.drafter_dir), "assistant": args.assistant,
                   "data": args.data or "HuggingFaceH4/MATH-500 (test)", "limit": args.limit, "seed": args.seed,
                   "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "batch_size": 1,
                   "stop_token_ids": ctx.eos_ids, "hf_dtype": str(ctx.hf_dtype), "warmup_tokens": args.warmup_tokens,
                   "system_budget_s": args.system_budget_s, "deadline_s": args.deadline_s,
                   "concurrency": args.concurrency, "throughput_prompts": max(args.throughput_prompts, len(prompts)),
                   "tpot": "median over prompts of decode time / tokens after the first emission (prefill "
                           "excluded); how each system is timed: scripts/bench/systems.py"},
        "prompts": [{"index": i, "id": p.id, "prompt_tokens": len(ids)} for i, (p, ids) in
                    enumerate(zip(problems, prompts))],
        "systems": systems, "skipped": skipped, "throughput": [], "throughput_skipped": {}, "throughput_error": None,
    }

    batch = throughput_prompts(prompts, args.throughput_prompts)
    ours_rows, peer_rows, outputs = [], [], {}

    def save() -> dict:
        result["throughput"] = report.compare_throughput(ours_rows + peer_rows, outputs, list(SYSTEMS),
                                                         args.concurrency, ctx.eos_ids)
        rows = report.system_rows(systems, result["throughput"], ctx.eos_ids)
        for name, row in rows.items():
            systems[name]["summary"] = row
        out.write_text(json.dumps(result, indent=1), encoding="utf-8")
        return rows

    last_hf = max((i for i, s in enumerate(args.systems) if s in HF_TARGET_SYSTEMS), default=-1)
    for i, name in enumerate(args.systems):
        why = ctx.why_skip(name)
        if why is not None:
            skipped[name] = why
            log(f"[{name}] skipped: {why}")
        else:
            try:
                budget = clock.system_budget(sum(ctx.why_skip(s) is None for s in args.systems[i:]))
                if name in PEER_SYSTEMS:
                    systems[name], rows, peer_skipped = run_peer(
                        ctx, name, problems, prompts, warm_prompt, batch if args.concurrency else [], budget,
                        args.peer_timeout_s, outputs)
                    peer_rows.extend(rows)
                    result["throughput_skipped"].update({f"C={c} {name}": why for c, why in peer_skipped.items()})
                else:
                    systems[name] = run_system(ctx, name, problems, prompts, warm_prompt, budget)
            except Exception as err:  # one system failing must not lose the others' numbers
                traceback.print_exc()
                skipped[name] = f"failed: {type(err).__name__}: {err}"
        if i == last_hf:
            ctx.hf_target = None
        release_memory(device)
        save()

    if args.concurrency:
        def on_row(rows, throughput_skipped):
            ours_rows[:] = rows
            result["throughput_skipped"].update(throughput_skipped)
            save()

        try:
            ours_rows[:], ours_skipped = run_throughput(ctx, batch, warm_prompt, clock, systems, outputs, on_row)
            result["throughput_skipped"].update(ours_skipped)
        except Exception as err:
            traceback.print_exc()
            result["throughput_error"] = f"{type(err).__name__}: {err}"
    rows = save()

    print("\n## Batch 1, greedy\n")
    print(report.latency_table(rows, skipped))
    if args.concurrency:
        print("\n## Throughput\n")
        print(report.throughput_table(result["throughput"]))
        for key, why in result["throughput_skipped"].items():
            print(f"- {key}: skipped, {why}")
        if result["throughput_error"]:
            print(f"\nthroughput runs failed: {result['throughput_error']}")
    print(f"\nraw JSON: {out} (total {time.perf_counter() - clock.start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

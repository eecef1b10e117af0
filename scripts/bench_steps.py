"""Where a decode step's time goes: wall time vs GPU kernel time vs the weight-streaming bound.

    python scripts/bench_steps.py --out bench-steps.json            # GPU, about 3-4 minutes
    python scripts/bench_steps.py --quick --out /tmp/quick.json     # CPU smoke run, tiny model

AR (no drafter) and DFlash (the shipped drafter) at several batch sizes, with CUDA graphs and with
enforce_eager=True, bf16 and fp8 KV. By default the target is a random-weight model of the default
target's exact shape, built locally, so nothing is downloaded; --model takes a real one instead.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import re
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_steps.py`: the repo's packages and scripts.bench
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from drafters import resolve_drafter_path  # noqa: E402
from drafters.compatibility import check_compatible  # noqa: E402
from drafters.dflash_model import DFlashDraftModel, read_dflash_config  # noqa: E402
from scripts.bench.host_profile import per_step, tables as host_tables  # noqa: E402
from scripts.bench.random_models import TARGET_SHAPE, TINY_SHAPE, random_target, tiny_drafter  # noqa: E402
from scripts.bench.runner import environment, release_memory  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.engine import decoding  # noqa: E402
from specdec.weights.demo_models import resolve_model  # noqa: E402

SHIPPED_DRAFTER = "qwen2.5-coder-1.5b-dflash-b16"
TAU_NOTE = ("With a random-weight target the drafts are rejected (tau ~ 1): a DFlash row is the cost of one "
            "draft + verify step, not a speedup.")
REAL_TAU_NOTE = "DFlash tok/step is the acceptance length tau of these random-id prompts."


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="demo name or HF dir (default: random weights, the default target's shape)")
    p.add_argument("--drafter", help=f"DFlash drafter (default {SHIPPED_DRAFTER}; --quick: a tiny random one)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--fp8-batches", type=int, nargs="*", default=[1, 32], help="none: no fp8 KV rows")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--profile-tokens", type=int, default=32, help="new tokens of the profiled generate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth probe")
    p.add_argument("--device", default="cuda")
    p.add_argument("--verify", nargs="+", choices=("chain", "tree", "auto"), default=["chain"],
                   help="the DFlash rows' verify policies (a row each; 'DFlash tree' for trees)")
    p.add_argument("--graphs-only", action="store_true", help="skip the eager rows (their kernel times are the "
                                                               "reference that flags graph kernels the profiler missed)")
    p.add_argument("--overlap-steps", choices=("on", "off"), default="on",
                   help="plain decoding's overlapped steps and DFlash's drafting ahead (the engine's default: on)")
    p.add_argument("--verify-ahead", action="store_true",
                   help="DFlash rows: a lone request's next verify queued with its draft (EngineConfig.verify_ahead)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes (overrides the above)")
    p.add_argument("--top-kernels", type=int, default=0, metavar="N",
                   help="also list each row's N largest kernels per step (time and launches, by name)")
    p.add_argument("--host-functions", type=int, default=0, metavar="N",
                   help="also list each row's N functions with the most host time per step, their own and (the "
                        "project's) with their calls' (one more generate under cProfile, which slows Python calls: "
                        "compare rows, not absolute times)")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.fp8_batches, args.prompt_tokens, args.max_new_tokens = [1, 2], [1], 16, 6
        args.profile_tokens, args.repeats, args.copy_mib, args.device = 4, 1, 16, "cpu"
    args.device = torch.device(args.device)
    return args


def copy_bandwidth(device: torch.device, mib: int, copies: int = 10) -> float:
    """Bytes per second of a large copy on `device`, read and write bytes both counted."""
    src = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    dst = src.clone()
    times = []
    for _ in range(copies):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); dst.copy_(src); end.record(); end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter(); dst.copy_(src); times.append(time.perf_counter() - t)
    return 2 * src.numel() / statistics.median(times)


def weight_bytes(model_dir: Path, drafter_dir: Path | None, itemsize: int) -> dict:
    """Bytes of weights one step reads. The embedding is excluded (only rows are gathered); lm_head is
    included, and counted twice for DFlash (the draft's logits go through the target's lm_head too)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    lm_head = model.get_output_embeddings().weight.numel()
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    out = {"target": (body + lm_head) * itemsize, "lm_head": lm_head * itemsize}
    if drafter_dir is not None:  # a drafter stored in fp8 or GGML blocks is dequantized to the target's dtype at load
        with torch.device("meta"):
            drafter = DFlashDraftModel(read_dflash_config(drafter_dir))
        out["drafter"] = sum(p.numel() for p in drafter.parameters()) * itemsize
        out["dflash"] = out["target"] + out["drafter"] + out["lm_head"]
    return out


def prompt_ids(model_dir: Path, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Seeded random token ids, avoiding special and added tokens (EOS among them)."""
    tokenizer, config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    banned = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    allowed = torch.tensor([i for i in range(min(config.vocab_size, len(tokenizer))) if i not in banned])
    picks = torch.randint(len(allowed), (count, length), generator=torch.Generator().manual_seed(seed))
    return allowed[picks].tolist()


def longest(results) -> dict:
    """The request that decoded longest: all start together, so its decode time spans every step."""
    s = max((r.stats for r in results), key=lambda s: s.decode_time)
    return {"decode_s": s.decode_time, "steps": s.verify_steps or s.generated_tokens - 1,
            "tokens": s.generated_tokens - 1}


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)


def step_wall(llm, prompts, max_new: int, repeats: int) -> dict:
    llm.generate(prompts, greedy(max_new))  # warm-up: lazy graph capture, kernel autotuning, allocator
    runs = [longest(llm.generate(prompts, greedy(max_new))) for _ in range(repeats)]
    return {"step_wall_ms": statistics.median(r["decode_s"] / r["steps"] for r in runs) * 1e3,
            "tpot_ms": statistics.median(r["decode_s"] / r["tokens"] for r in runs) * 1e3,
            "steps": runs[0]["steps"], "tokens_per_step": runs[0]["tokens"] / runs[0]["steps"]}


# a host event named like a CUDA runtime or driver call (cudaGraphLaunch, cuLaunchKernel, ...)
CUDA_CALL = re.compile(r"cu(da)?[A-Z]")


def event_kind(event) -> str:
    """'kernel', 'gpu_memcpy', 'gpu_memset' or another kineto activity type."""
    try:
        return event.activity_type()
    except AttributeError:  # an older torch: device events by device type, copies and CUDA calls by name
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            return "cuda_runtime" if CUDA_CALL.match(event.name()) else "host"
        return "gpu_memcpy" if event.name().startswith(("Memcpy", "Memset")) else "kernel"


@contextmanager
def host_timers(llm):
    """Host seconds spent, inside the block, planning attention (every plan / plan_graph of the target's and
    the drafter's backends: FlashInfer's plans included) and in the step's one device-to-host transfer
    (where the host waits for the GPU)."""
    spent = {"plan": 0.0, "transfer": 0.0}

    def timed(key, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return call

    runners = [llm.engine.runner, llm.engine.drafter]
    backends = [r.attn for r in runners if getattr(r, "attn", None) is not None]
    patched = [(b, name) for b in backends for name in ("plan", "plan_graph") if hasattr(b, name)]
    for backend, name in patched:  # instance attributes shadow the class's methods until deleted
        setattr(backend, name, timed("plan", getattr(backend, name)))
    original = decoding.StepTransfer.read
    decoding.StepTransfer.read = timed("transfer", original)
    try:
        yield spent
    finally:
        decoding.StepTransfer.read = original
        for backend, name in patched:
            delattr(backend, name)


def host_split(llm, prompts, max_new: int) -> dict:
    """Per decode step of one generate: host ms planning attention, ms waiting in the step's transfer, and
    the rest of the wall time (scheduling, staging, launches, sampling, commits). The sums include the
    generate's one prefill step, a small share over its decode steps."""
    with host_timers(llm) as spent:
        results = llm.generate(prompts, greedy(max_new))
    run = longest(results)
    per_step = lambda seconds: seconds / run["steps"] * 1e3  # noqa: E731
    return {"plan_ms": per_step(spent["plan"]), "transfer_wait_ms": per_step(spent["transfer"]),
            "other_host_ms": per_step(run["decode_s"] - spent["plan"] - spent["transfer"])}


def host_functions(llm, prompts, max_new: int, top: int) -> dict:
    """Host time per decode step of one generate under cProfile (`scripts.bench.host_profile.per_step`, this file's
    functions left out of the project's)."""
    profile = cProfile.Profile()
    profile.enable()
    results = llm.generate(prompts, greedy(max_new))
    profile.disable()
    return per_step(pstats.Stats(profile).stats, longest(results)["steps"], top, exclude=__file__)


def kernel_name(event) -> str:
    """A kernel's name without its template arguments and parameters (`flashinfer::BatchPrefill...Kernel`)."""
    return event.name().split("<")[0].split("(")[0]


def device_time(llm, prompts, max_new: int, cuda: bool) -> tuple[float, float, int, Counter, Counter]:
    """(kernel s, memcpy + memset s, steps, kernel ns by name, launches by name) of one profiled generate. The raw
    kineto events are read: this skips the profiler's costly event-tree building, and CUDA-graph replays show as
    their kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        results = llm.generate(prompts, greedy(max_new))
    ns = {"kernel": 0, "gpu_memcpy": 0, "gpu_memset": 0}
    by_name, launches = Counter(), Counter()
    for e in prof.profiler.kineto_results.events():
        if (kind := event_kind(e)) in ns:
            ns[kind] += e.duration_ns()
            if kind == "kernel":
                by_name[kernel_name(e)] += e.duration_ns()
                launches[kernel_name(e)] += 1
    return (ns["kernel"] / 1e9, (ns["gpu_memcpy"] + ns["gpu_memset"]) / 1e9, longest(results)["steps"], by_name,
            launches)


def step_kernels(llm, prompts, max_new: int, cuda: bool, top: int = 0) -> dict:
    """Device time per step: a generate minus a prefill-only generate of the same prompts; with `top`, the `top`
    kernels that take the most time per step, by name: [name, us per step, launches per step]."""
    kernel, copies, steps, by_name, launches = device_time(llm, prompts, max_new, cuda)
    kernel_pre, copies_pre, _, by_name_pre, launches_pre = device_time(llm, prompts, 1, cuda)
    if not cuda:  # the profiler ran (CPU events only), but there are no kernel times
        return {"kernel_ms": None, "memcpy_ms": None}
    by_name.subtract(by_name_pre)
    launches.subtract(launches_pre)
    largest = [[name, ns / steps / 1e3, launches[name] / steps] for name, ns in by_name.most_common(top)]
    return {"kernel_ms": (kernel - kernel_pre) / steps * 1e3, "memcpy_ms": (copies - copies_pre) / steps * 1e3,
            **({"top_kernels": largest} if top else {})}


def bench_config(model: str, drafter, batches: list[int], prompts, args, **engine) -> tuple[list[dict], float | None]:
    """One LLM, reused for every batch size; all prompts of a batch are admitted in one prefill."""
    pages = max(batches) * -(-(args.prompt_tokens + args.max_new_tokens + 64) // 16)
    llm = LLM(model, drafter=drafter, device=str(args.device), num_kv_pages=pages, max_num_seqs=max(batches),
              max_prefill_tokens=max(batches) * args.prompt_tokens, **engine)
    rows = []
    for b in batches:
        rows.append({"batch": b, **step_wall(llm, prompts[:b], args.max_new_tokens, args.repeats),
                     **host_split(llm, prompts[:b], args.max_new_tokens),
                     **step_kernels(llm, prompts[:b], args.profile_tokens, args.device.type == "cuda",
                                    args.top_kernels),
                     **(host_functions(llm, prompts[:b], args.max_new_tokens, args.host_functions)
                        if args.host_functions else {})})
        print(f"  batch {b}: {rows[-1]['step_wall_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    capture = getattr(llm.engine, "graph_capture_seconds", None)  # read late: capture may wait for a first step
    del llm
    release_memory(args.device)
    return rows, capture


def derive(row: dict, eager_kernel_ms: float | None, bandwidth: float, nbytes: int) -> dict:
    """Busy %, bound and ratio. A graph row's kernel time far below eager's (or none at all) means the
    profiler did not see the graph's kernels: n/a, rather than a misleading number."""
    row["bound_ms"] = nbytes / bandwidth * 1e3
    kernel = row["kernel_ms"]
    if kernel is not None and (kernel <= 0 or (eager_kernel_ms and kernel < 0.5 * eager_kernel_ms)):
        row.update(kernel_ms_raw=kernel, kernel_ms=None, note="kernels not visible to the profiler")
        kernel = None
    row["busy_pct"] = None if kernel is None else 100 * kernel / row["step_wall_ms"]
    row["wall_over_kernel"] = None if kernel is None else row["step_wall_ms"] / kernel
    return row


def models_to_run(args, work: Path) -> tuple[str, Path, str | None, str | None]:
    """(target, its directory, drafter, why DFlash is skipped). A drafter that does not fit the target
    (a smaller --model, say) leaves the AR rows only."""
    shape = TINY_SHAPE if args.quick else TARGET_SHAPE
    model = args.model or str(random_target(work / "target", shape, args.device))
    release_memory(args.device)
    model_dir = resolve_model(model)
    drafter = args.drafter or (str(tiny_drafter(work / "drafter", model_dir)) if args.quick else SHIPPED_DRAFTER)
    try:
        check_compatible(read_dflash_config(resolve_drafter_path(drafter)), AutoConfig.from_pretrained(model_dir))
    except (ValueError, FileNotFoundError) as err:
        return model, model_dir, None, str(err)
    return model, model_dir, drafter, None


def run_rows(info: dict, model: str, drafter: str | None, prompts, args) -> None:
    base_kv = "bf16" if args.device.type == "cuda" else "fp32"  # "auto" = the model's dtype
    for kv, batches in ((base_kv, args.batches), ("fp8", args.fp8_batches)):
        if not batches:
            continue
        dflash = [("DFlash" if verify == "chain" else f"DFlash {verify}", drafter, verify) for verify in args.verify]
        for system, draft, verify in [("AR", None, "chain"), *(dflash if drafter else [])]:
            eager_kernels = {}
            # eager first: its kernel time is the reference for the graph rows, and the profiler is
            # initialised before any graph is captured (profiling graphs captured before the profiler's
            # first use is a known hazard)
            for graphs in (True,) if args.graphs_only else (False, True):
                name = f"{system} {kv} {'graphs' if graphs else 'eager'}"
                print(name, file=sys.stderr, flush=True)
                rows, info["graph_capture_s"][name] = bench_config(
                    model, draft, batches, prompts, args, enforce_eager=not graphs,
                    kv_cache_dtype="fp8" if kv == "fp8" else "auto", verify=verify,
                    overlap_steps=args.overlap_steps == "on", verify_ahead=args.verify_ahead)
                nbytes = info["weight_bytes"]["dflash" if draft else "target"]
                for r in rows:
                    eager = eager_kernels.get(r["batch"]) if graphs else None
                    info["rows"].append(derive({"system": system, "kv": kv, "graphs": graphs, **r}, eager,
                                               info["copy_bandwidth"], nbytes))
                    if not graphs:
                        eager_kernels[r["batch"]] = r["kernel_ms"]


def report(info: dict) -> str:
    env, w, gib = info["environment"], info["weight_bytes"], 1 << 30
    fmt = lambda value, spec=".2f": "n/a" if value is None else format(value, spec)  # noqa: E731
    dflash = (f"; DFlash {w['dflash'] / gib:.3f} GiB (+ drafter {w['drafter'] / 2**20:.1f} MiB, + lm_head again"
              f" for the draft logits)") if "dflash" in w else ""
    captures = ", ".join(f"{k} {v:.2f} s" for k, v in info["graph_capture_s"].items() if v is not None)
    lines = [f"# Step benchmark: {info['model']}", "",
             f"{env['device_name']}; torch {env['torch']}; flashinfer {env['flashinfer']}; transformers "
             f"{env['transformers']}; commit {env['git_commit']}",
             f"Drafter {info['drafter']}. {info['tau_note']}" if info["drafter"] else
             f"No DFlash rows: {info['skipped']}",
             f"Prompts: batch x {info['prompt_tokens']} random token ids; {info['max_new_tokens']} new tokens, greedy, "
             f"ignore_eos. Step wall = the longest request's decode time / its steps (AR: tokens - 1, DFlash: verify "
             f"steps), median of {info['repeats']} after a warm-up.",
             f"Copy bandwidth {info['copy_bandwidth'] / 1e9:.0f} GB/s ({info['copy_mib']} MiB copy, read + write bytes "
             f"counted, median of 10). Weights read per step: AR {w['target'] / gib:.3f} GiB (no embedding, lm_head "
             f"included){dflash}. Bound = weight bytes / copy bandwidth.",
             f"GPU kernel ms: torch.profiler kernel durations of a {info['profile_tokens']}-token generate minus a "
             f"prefill-only one, per step; memcpy + memset apart. n/a: no CUDA, or the kernels were not visible.",
             f"CUDA-graph capture: {captures or 'not reported by the engine'}."
             + (" CPU: the engine runs eager whatever 'graphs' says." if env["device"] == "cpu" else ""), "",
             "Host split (one more generate, per step of the longest request): plan = attention planning "
             "(FlashInfer's plans included), wait = the step's device-to-host transfer (the host waiting for the "
             "GPU), other = the rest of the step's wall time.", "",
             "| system | KV | graphs | batch | step wall ms | GPU kernel ms | memcpy ms | busy % | bound ms | "
             "wall/kernel | tok/step | TPOT ms | plan / wait / other ms |", "|" + "---|" * 13]
    for r in info["rows"]:
        lines.append(f"| {r['system']} | {r['kv']} | {'yes' if r['graphs'] else 'no'} | {r['batch']} | "
                     f"{r['step_wall_ms']:.2f} | {fmt(r['kernel_ms'])} | {fmt(r['memcpy_ms'], '.3f')} | "
                     f"{fmt(r['busy_pct'], '.0f')} | {r['bound_ms']:.2f} | {fmt(r['wall_over_kernel'])} | "
                     f"{r['tokens_per_step']:.2f} | {r['tpot_ms']:.2f} | {r['plan_ms']:.2f} / "
                     f"{r['transfer_wait_ms']:.2f} / {r['other_host_ms']:.2f} |")
    for r in info["rows"]:
        if r.get("top_kernels"):
            lines += ["", f"{r['system']}, {r['kv']}, {'graphs' if r['graphs'] else 'eager'}, batch {r['batch']}: "
                      "the largest kernels per step", "", "| kernel | us per step | launches per step |", "|---|---|---|"]
            lines += [f"| `{name}` | {us:.1f} | {count:.1f} |" for name, us, count in r["top_kernels"]]
        if r.get("host_functions"):
            lines += ["", f"{r['system']}, {r['kv']}, {'graphs' if r['graphs'] else 'eager'}, batch {r['batch']}:"]
            lines += host_tables(r)
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as work:
        model, model_dir, drafter, skipped = models_to_run(args, Path(work))
        name = args.model or ("random-weight tiny Qwen2" if args.quick else
                              "random-weight Qwen2, the shape of qwen2.5-coder-1.5b-instruct")
        info = {"environment": environment(args.device), "model": name, "drafter": drafter, "skipped": skipped,
                "tau_note": REAL_TAU_NOTE if args.model else TAU_NOTE, "prompt_tokens": args.prompt_tokens,
                "max_new_tokens": args.max_new_tokens, "profile_tokens": args.profile_tokens, "repeats": args.repeats,
                "overlap_steps": args.overlap_steps, "verify_ahead": args.verify_ahead,
                "copy_mib": args.copy_mib, "copy_bandwidth": copy_bandwidth(args.device, args.copy_mib),
                "weight_bytes": weight_bytes(model_dir, drafter and resolve_drafter_path(drafter),
                                             2 if args.device.type == "cuda" else 4),  # "auto": bf16 / fp32
                "graph_capture_s": {}, "rows": []}
        prompts = prompt_ids(model_dir, max(args.batches + args.fp8_batches), args.prompt_tokens)
        run_rows(info, model, drafter, prompts, args)
    print(report(info))
    if args.out:
        Path(args.out).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a decode step's host time goes: cProfile of generate calls, per function, per step.

    python scripts/profile_step_host.py --batches 1 16 64 --out profile.txt     # GPU, about a minute
    python scripts/profile_step_host.py --quick                                 # CPU smoke run, tiny model
    python scripts/profile_step_host.py --batches 1 --timeline   # + the host's path between two verifies
    python scripts/profile_step_host.py --batches 1 --systems DFlash --verify chain tree   # token-tree steps too
    python scripts/profile_step_host.py --quick --batches 1 --systems DFlash --verify chain tree --ops
        # + the tensor operations a step dispatches (on the CPU all of its work: scripts/bench/op_count.py)

The model is `bench_steps.py`'s (random weights of the default target's shape, the shipped drafter) unless
--model names one. For each system and batch: one warm-up generate, then one generate under cProfile; the
report lists the functions with the most own (then cumulative) time over that generate, headed by its number
of decode steps to divide by.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench_steps import greedy, longest, models_to_run, prompt_ids  # noqa: E402
from scripts.bench.op_count import OpCount  # noqa: E402
from scripts.bench.runner import release_memory  # noqa: E402
from scripts.bench.step_timeline import StepTimeline  # noqa: E402
from specdec import LLM  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="demo name or HF dir (default: random weights, the default target's shape)")
    p.add_argument("--drafter", help="DFlash drafter (default: the shipped one; --quick: a tiny random one)")
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 1 16 64; --quick: 1 2)")
    p.add_argument("--systems", nargs="+", choices=("AR", "DFlash"), default=["DFlash", "AR"])
    p.add_argument("--prompt-tokens", type=int, help="default: 700 (--quick: 16)")
    p.add_argument("--max-new-tokens", type=int, help="default: 128 (--quick: 6)")
    p.add_argument("--top", type=int, default=45, help="functions listed per profile")
    p.add_argument("--device", default="cuda")
    p.add_argument("--verify", nargs="+", choices=("chain", "tree", "auto"), default=["chain"],
                   help="DFlash: the verify policies profiled, one engine each")
    p.add_argument("--timeline", action="store_true",
                   help="DFlash chain: also the host's path from a step's tokens to the next verify's launch, per piece")
    p.add_argument("--ops", action="store_true",
                   help="also count the tensor operations each decode step dispatches (outside CUDA graphs on a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: tiny sizes (sizes given still apply: e.g. --batches 256 for the host's "
                        "per-request work)")
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args(argv)
    defaults = ([1, 2], 16, 6) if args.quick else ([1, 16, 64], 700, 128)
    args.batches, args.prompt_tokens, args.max_new_tokens = (given or default for given, default in zip(
        (args.batches, args.prompt_tokens, args.max_new_tokens), defaults))
    if args.quick:
        args.device, args.top = "cpu", 10
    args.device = torch.device(args.device)
    return args


def profile(llm, prompts, max_new: int, top: int) -> str:
    llm.generate(prompts, greedy(max_new))  # warm-up: graphs, autotuning, allocator
    profiler = cProfile.Profile()
    profiler.enable()
    results = llm.generate(prompts, greedy(max_new))
    profiler.disable()
    steps = longest(results)["steps"]
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(top)
    stream.write("\n-- by cumulative time --\n")
    stats.sort_stats("cumulative").print_stats(top)
    return f"{steps} decode steps; wall of the profiled generate in the tables (divide by steps)\n{stream.getvalue()}"


def main(argv=None) -> int:
    args = parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="profile-host-") as work:
        model, model_dir, drafter, skipped = models_to_run(args, Path(work))
        prompts = prompt_ids(model_dir, max(args.batches), args.prompt_tokens)
        runs = [(system, verify) for system in args.systems for verify in (args.verify if system == "DFlash" else
                                                                                   ["chain"])]
        for system, verify in runs:
            if system == "DFlash" and drafter is None:
                out.append(f"# DFlash skipped: {skipped}")
                continue
            name = system if verify == "chain" else f"{system} {verify}"
            pages = max(args.batches) * -(-(args.prompt_tokens + args.max_new_tokens + 64) // 16)
            llm = LLM(model, drafter=drafter if system == "DFlash" else None, device=str(args.device),
                      num_kv_pages=pages, max_num_seqs=max(args.batches),
                      max_prefill_tokens=max(args.batches) * args.prompt_tokens, verify=verify)
            for b in args.batches:
                out.append(f"# {name}, batch {b}\n" + profile(llm, prompts[:b], args.max_new_tokens, args.top))
                # the timeline marks a chain step's pieces (a tree step's verify is not a block)
                if args.timeline and system == "DFlash" and verify == "chain":
                    with StepTimeline(llm) as timeline:
                        llm.generate(prompts[:b], greedy(args.max_new_tokens))
                    out[-1] += "\n" + timeline.report() + "\n"
                if args.ops:
                    with OpCount(llm) as ops:
                        llm.generate(prompts[:b], greedy(args.max_new_tokens))
                    out[-1] += "\n" + ops.report() + "\n"
                print(out[-1], flush=True)
            del llm
            release_memory(args.device)
    if args.out:
        Path(args.out).write_text("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

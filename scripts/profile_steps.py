"""Where one decode step's time goes, at batch 1 with CUDA graphs: the GPU kernels per step and the host's
CUDA calls per step (torch profiler, grouped by name, with each call's longest duration), and the host functions
per step (cProfile), for AR and DFlash. Under the profiler a graph launch takes far longer than without it (a
verify graph's 570-605 us against 22 us on an H200): read `cudaGraphLaunch` times as the profiler's, not the step's.

    python scripts/profile_steps.py [--model NAME_OR_DIR] [--kv auto|fp8] [--top 15] [--verify chain tree]
                                    [--prompt-tokens 120]

Same models as scripts/bench_steps.py (by default a random-weight target of the default target's shape
and the shipped drafter).
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

from scripts.bench.gpu_profile import GPU_ACTIVITIES, Tally  # noqa: E402
from scripts.bench_steps import event_kind, greedy, models_to_run, parse_args as bench_args, prompt_ids  # noqa: E402
from specdec import LLM  # noqa: E402


# the host's calls into CUDA as the profiler records them (launches, copies, waits)
API_ACTIVITIES = ("cuda_runtime", "cuda_driver")


def kernels_per_step(llm, prompts, tokens: int, top: int) -> str:
    """The GPU's kernels per step, and the host's CUDA calls per step (waits for the GPU among them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        results = llm.generate(prompts, greedy(tokens))
    steps = results[0].stats.verify_steps or results[0].stats.generated_tokens - 1
    device, api = Tally(), Tally()
    for e in prof.profiler.kineto_results.events():
        kind = event_kind(e)
        if kind in GPU_ACTIVITIES:
            device.add(e.name()[:90], e.duration_ns())
        elif kind in API_ACTIVITIES:
            api.add(e.name()[:90], e.duration_ns())
    return "\n".join([f"{device.total() / steps / 1e3:.1f} us of device time per step over {steps} steps "
                      "(prefill included); top kernels per step:", *device.lines(steps, top),
                      f"{api.total() / steps / 1e3:.1f} us of the host's CUDA calls per step; the largest:",
                      *api.lines(steps, top, longest=True)])


def host_per_step(llm, prompts, tokens: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, greedy(tokens))
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--kv", default="auto")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--tokens", type=int, default=64)
    own, rest = p.parse_known_args(argv)
    args = bench_args(rest + (["--model", own.model] if own.model else []))
    with tempfile.TemporaryDirectory() as work:
        model, model_dir, drafter, _ = models_to_run(args, Path(work))
        prompts = prompt_ids(model_dir, 1, args.prompt_tokens)
        systems = [("AR", None, {})] + [(f"DFlash {verify}", drafter, {"verify": verify}) for verify in args.verify]
        for name, draft, options in systems:
            llm = LLM(model, drafter=draft, device="cuda", kv_cache_dtype=own.kv, num_kv_pages=512, max_num_seqs=64,
                      **options)
            llm.generate(prompts, greedy(own.tokens))
            print(f"## {name} ({own.kv} KV), batch 1, {args.prompt_tokens}-token prompt\n"
                  f"{kernels_per_step(llm, prompts, own.tokens, own.top)}\n")
            print(host_per_step(llm, prompts, own.tokens, own.top))
            del llm
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

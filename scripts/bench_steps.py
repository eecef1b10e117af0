"""Short GPU benchmark of the engine's steps: autoregressive decode vs speculative steps.

    python scripts/bench_steps.py --model smollm2-135m-instruct --out results.json

Systems: AR; DFlash with a random-weight drafter (tau ~ 1: measures draft + verify cost per step);
a scripted drafter that proposes the AR continuation (high tau: the verify path's ceiling).
Each for bf16 and FP8 KV caches, batch 1, greedy; median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
from transformers import AutoConfig

from specdec import LLM, SamplingParams
from specdec.models.demo_models import resolve_model

PROMPTS = ["Write a Python function that checks whether a number is prime, with a docstring.",
           "Explain the difference between a process and a thread."]


def run(llm, params, repeats):
    runs = []
    for _ in range(repeats):
        results = llm.generate(PROMPTS[:1], params, chat=True)
        s = llm.last_summary
        steps = s.verify_steps or results[0].stats.generated_tokens - 1
        runs.append({"tpot_ms": s.tpot_s * 1e3, "tokens_per_s": s.tokens_per_s, "tau": s.tau_mean_of_requests,
                     "step_ms": results[0].stats.decode_time / max(steps, 1) * 1e3})
    return {k: statistics.median(r[k] for r in runs) if runs[0][k] is not None else None for k in runs[0]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import sys

    sys.path.insert(0, ".")
    from tests.drafter_helpers import ScriptedDrafter, build_random_drafter

    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    drafter_dir = tempfile.mkdtemp()
    build_random_drafter(drafter_dir, AutoConfig.from_pretrained(resolve_model(args.model)), block_size=16,
                         num_layers=2, heads=8, kv_heads=2, head_dim=64, intermediate_size=1024, std=0.02,
                         mask_token_id=0)
    rows = {}
    for kv in ("auto", "fp8"):
        common = dict(device="cuda", kv_cache_dtype=kv, num_kv_pages=4096)
        ar = LLM(args.model, **common)
        rows[f"ar-{kv}"] = run(ar, params, args.repeats)
        script = {tuple(r.prompt_token_ids): r.token_ids for r in ar.generate(PROMPTS[:1], params, chat=True)}
        rows[f"dflash-random-{kv}"] = run(LLM(args.model, drafter=drafter_dir, **common), params, args.repeats)
        oracle = ScriptedDrafter(script, 16, ar.engine.model.config.vocab_size)
        rows[f"scripted-b16-{kv}"] = run(LLM(args.model, drafter=oracle, **common), params, args.repeats)
        del ar
        torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "rows": rows}
    try:
        import flashinfer

        info["flashinfer"] = flashinfer.__version__
    except ImportError:
        pass
    print(json.dumps(info, indent=1))
    print("\n| system | TPOT ms | tok/s | tau | step ms |\n|---|---|---|---|---|")
    for name, r in rows.items():
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"| {name} | {r['tpot_ms']:.2f} | {r['tokens_per_s']:.1f} | {tau} | {r['step_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()

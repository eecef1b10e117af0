"""What a request feature costs against plain requests, in the library: tokens/s and TPOT at batch 1 and
under load, speculation on.

    python scripts/bench_features.py --model NAME --out features.json        # GPU
    python scripts/bench_features.py --quick --out /tmp/features.json        # CPU smoke run

Each concurrency C runs the same --requests chat prompts (math500 and coding requests alternating,
scripts/bench/chat_prompts.py) greedily with `max_num_seqs` = C, once per feature: `plain` (no extra),
`logprobs` (SamplingParams.logprobs = 5), `penalties` (frequency and presence penalties of 0.5) and
`json_schema` (the answer as {"reasoning": ..., "answer": ...}, structured output; its answers end where the
object does, so their lengths differ from the others'). A warm-up call comes first; every feature runs
--repeats times and the median is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_features.py`: the repo's packages and scripts.bench
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench.chat_prompts import load_prompts, take  # noqa: E402
from scripts.bench.random_models import TINY_SHAPE, random_target  # noqa: E402
from scripts.bench.runner import environment, release_memory  # noqa: E402
from specdec import LLM, SamplingParams, StructuredOutput  # noqa: E402

ANSWER_SCHEMA = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "string"}},
                 "required": ["reasoning", "answer"], "additionalProperties": False}
FEATURES = {"plain": {}, "logprobs": {"logprobs": 5}, "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5},
            "json_schema": {"structured_output": StructuredOutput(json=ANSWER_SCHEMA)}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--drafter", default="auto", help="as LLM's drafter: auto, none, a name or a directory")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--requests", type=int, default=None, help="per run (default: 4 at C=1, else 2 x C)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny random model, small sizes (no json_schema)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def run(llm: LLM, prompts, params: SamplingParams) -> dict:
    results = llm.generate(prompts, params, chat=llm.tokenizer.chat_template is not None)
    summary = llm.last_summary
    assert all(r.logprobs is not None for r in results) == (params.logprobs is not None)
    if params.structured_output is not None:  # finished answers are the schema's objects
        for result in results:
            if result.finish_reason == "stop":
                assert set(json.loads(result.text)) == {"reasoning", "answer"}, result.text
    return {"tokens_per_s": summary.tokens_per_s, "tpot_ms": (summary.tpot_s or 0) * 1e3,
            "tau": summary.tau_mean_of_requests, "tokens": sum(len(r.token_ids) for r in results)}


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, drafter, options = args.model, None if args.drafter == "none" else args.drafter, {}
        if args.quick:
            model = str(random_target(Path(tmp) / "target", TINY_SHAPE, torch.device("cpu")))
            drafter, options = None, {"device": "cpu", "num_kv_pages": 512}
            args.concurrency, args.max_new_tokens, args.repeats = [1, 4], 8, 1
        for concurrency in args.concurrency:
            llm = LLM(model, drafter=drafter, max_num_seqs=concurrency, **options)
            count = args.requests or (4 if concurrency == 1 else 2 * concurrency)
            prompts = [p.text for p in take(load_prompts("mixed", 0), count)]
            if args.quick:
                prompts = [llm.tokenizer.encode(p)[:24] or [5] for p in prompts]
            run(llm, prompts[:concurrency], SamplingParams(max_new_tokens=8))  # warm-up
            # the quick run's word-level tokenizer ("t0", "t1", ...) cannot spell JSON
            features = {k: v for k, v in FEATURES.items() if not (args.quick and k == "json_schema")}
            for name, extra in features.items():
                params = SamplingParams(max_new_tokens=args.max_new_tokens, **extra)
                runs = [run(llm, prompts, params) for _ in range(args.repeats)]
                row = {"concurrency": concurrency, "feature": name, "requests": count,
                       **{key: statistics.median(r[key] for r in runs if r[key] is not None)
                          if any(r[key] is not None for r in runs) else None for key in runs[0]}}
                rows.append(row)
                print(json.dumps(row), flush=True)
            device = llm.engine.device
            del llm
            release_memory(device)
    print("\n| concurrency | feature | tokens/s | TPOT ms | tau |\n|---|---|---|---|---|")
    for row in rows:
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        print(f"| {row['concurrency']} | {row['feature']} | {row['tokens_per_s']:.0f} | {row['tpot_ms']:.2f} | {tau} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"command_line": " ".join(sys.argv), "environment": environment(device),
                                              "rows": rows}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

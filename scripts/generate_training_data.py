"""Drafter training data: the target's own answers to the MATH training problems, in shards.

    python scripts/generate_training_data.py --out data/train-qwen2.5-coder-1.5b \
        [--target qwen2.5-coder-1.5b-instruct] [--problems ../shared/data/math_train.jsonl] \
        [--max-new-tokens 1024] [--samples-per-problem K --temperature T] [--shard-size 256] \
        [--batch-size 128] [--start S] [--limit N] [--time-budget-s 540]

Prompts use the math500 format (one user turn: problem + "Please reason step by step, and put
your final answer within \\boxed{}.", chat template with the generation prompt). Answers come from
our engine: greedy, plus K sampled ones per problem when asked. Finished shards are skipped, so the
same command resumes an interrupted run; --time-budget-s stops before a shard that would not fit.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from drafters.training.data import load_samples
from drafters.training.generation import GenerationSettings, generate_shards, math_prompt_ids, read_problems

DEFAULT_PROBLEMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "math_train.jsonl"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory of the shards")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="demo name or HF model directory")
    p.add_argument("--problems", default=str(DEFAULT_PROBLEMS), help="JSONL with a `problem` field (never math500)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy answer (sampled answers only)")
    p.add_argument("--samples-per-problem", type=int, default=0, help="extra sampled answers per problem")
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled answers")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=int, default=256, help="problems per shard")
    p.add_argument("--start", type=int, default=0, help="first problem (a multiple of --shard-size)")
    p.add_argument("--limit", type=int, default=None, help="number of problems from --start")
    p.add_argument("--batch-size", type=int, default=128, help="requests decoded together (max_num_seqs)")
    p.add_argument("--num-kv-pages", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop before a shard that would end past this")
    return p.parse_args(argv)


def main(argv=None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    if "math500" in Path(args.problems).name.lower():
        raise SystemExit(f"{args.problems} looks like the math500 benchmark; training on it is not allowed")
    from specdec import LLM

    llm = LLM(args.target, device=args.device, dtype=args.dtype, max_num_seqs=args.batch_size,
              num_kv_pages=args.num_kv_pages)
    problems = read_problems(args.problems)
    end = len(problems) if args.limit is None else min(len(problems), args.start + args.limit)
    prompts: list[list[int]] = [[] for _ in problems]  # only the selected range is tokenized
    for i in range(args.start, end):
        prompts[i] = math_prompt_ids(llm.tokenizer, problems[i])
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, greedy=not args.no_greedy,
                                  samples_per_problem=args.samples_per_problem, temperature=args.temperature,
                                  top_p=args.top_p, seed=args.seed, shard_size=args.shard_size)
    metadata = {"target": str(args.target), "problems": str(args.problems)}
    deadline = None if args.time_budget_s is None else started + args.time_budget_s
    files = generate_shards(llm.engine, prompts, args.out, settings, start=args.start, limit=args.limit,
                            metadata=metadata, deadline=deadline)
    expected = -(-(end - args.start) // args.shard_size)
    if len(files) < expected:
        print(f"time budget: {len(files)} of {expected} shards finished; run the same command again to continue")
    if not files:
        return
    samples = load_samples(args.out)
    print(f"{args.out}: {len(samples)} samples, {int(samples.lengths.sum())} tokens, "
          f"{int((samples.lengths - samples.prompt_lens.long()).sum())} response tokens")


if __name__ == "__main__":
    main()

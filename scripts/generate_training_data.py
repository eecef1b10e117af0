"""Drafter training data: the target's own answers to a mix of prompts (math, code, general,
self-instruct), in resumable shards, each sample tagged with its domain.

    python scripts/generate_training_data.py --out data/mix-qc15 \
        [--source math:7500 --source code:6000 --source general:2000 --source selfinstruct:3000 | --prompts FILE.jsonl] \
        [--problems ../shared/data/math_train.jsonl] [--seed 0] [--exclude-recipe OLD/prompts.recipe.json] \
        [--prompts-only] \
        [--target qwen2.5-coder-1.5b-instruct] [--max-new-tokens 1024] \
        [--samples-per-problem K --temperature 0.7,1.0] [--shard-size 256] [--batch-size 128] \
        [--start S] [--limit N] [--time-budget-s 540]

First the prompt list is built (`drafters.training.prompt_set`; default sources: math:7500 code:6000
general:2000) and stored as <out>/prompts.jsonl, or read back from there when an earlier run built it
from the same recipe. Every prompt is one user turn through the target's chat template (math problems
end with the math500 instruction). Answers come from our engine: greedy, plus K sampled ones per
prompt when asked (sample k at the k-th of the comma-separated temperatures, round-robin, each with
its own seed). Finished shards are skipped, so the same command resumes an interrupted run;
--time-budget-s stops before a shard (or a self-instruct round) that would not fit.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from functools import cache
from pathlib import Path

from drafters.training.data import load_samples
from drafters.training.generation import GenerationSettings, generate_shards
from drafters.training.prompt_set import (DEFAULT_SOURCES, PROMPTS_FILE, SourceInputs, SourceSpec, build_prompts,
                                          prompt_set, read_prompt_file, read_recipe, recipe_of_file,
                                          recipe_of_sources, recipe_texts,
                                          refuse_benchmark_file)
from drafters.training.self_instruct import engine_completions
from specdec.weights.demo_models import DEFAULT_TARGET

DEFAULT_PROBLEMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "math_train.jsonl"


def temperature_list(text: str) -> tuple[float, ...]:
    return tuple(float(t) for t in text.split(","))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory of the prompt list and the shards")
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo name or HF model directory")
    p.add_argument("--source", action="append", type=SourceSpec.parse, default=None, metavar="NAME:COUNT",
                   help=f"a prompt source and how many prompts to take from it (COUNT or 'all'), repeatable; "
                        f"math, code, general, selfinstruct (default: {' '.join(DEFAULT_SOURCES)})")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="ready prompts (`prompt` and `domain` per line) instead of --source")
    p.add_argument("--problems", default=str(DEFAULT_PROBLEMS), help="the math source: JSONL with a `problem` field")
    p.add_argument("--exclude-recipe", action="append", default=[], metavar="prompts.recipe.json",
                   help="leave out every prompt of the list this recipe builds (e.g. earlier training data's), "
                        "repeatable; each --source then takes its first COUNT other prompts")
    p.add_argument("--prompts-only", action="store_true", help="build and store the prompt list, answer nothing")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy answer (sampled answers only)")
    p.add_argument("--samples-per-problem", type=int, default=0, help="extra sampled answers per prompt")
    p.add_argument("--temperature", type=temperature_list, default=(0.8,),
                   help="for the sampled answers; a comma-separated list is used round-robin (e.g. 0.7,1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="prompt selection and order, sampled answers")
    p.add_argument("--shard-size", type=int, default=256, help="prompts per shard")
    p.add_argument("--start", type=int, default=0, help="first prompt (a multiple of --shard-size)")
    p.add_argument("--limit", type=int, default=None, help="number of prompts from --start")
    p.add_argument("--batch-size", type=int, default=128, help="requests decoded together (max_num_seqs)")
    p.add_argument("--num-kv-pages", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop before a shard that would end past this")
    args = p.parse_args(argv)
    if args.prompts and (args.source or args.exclude_recipe):
        p.error("give --source (and --exclude-recipe) or --prompts, not both")
    return args


def load_or_build_prompts(args, target, deadline):
    """The stored or newly built prompt list; None when the time budget stopped self-instruct."""
    for path in filter(None, (args.prompts, args.problems)):  # before any work
        refuse_benchmark_file(path)
    if args.prompts:
        recipe = recipe_of_file(args.prompts)
        return prompt_set(args.out, recipe, lambda: read_prompt_file(args.prompts))
    specs = args.source or [SourceSpec.parse(s) for s in DEFAULT_SOURCES]
    excluded_recipes = [read_recipe(path) for path in args.exclude_recipe]
    recipe = recipe_of_sources(specs, args.seed, args.problems, excluded_recipes)
    inputs = SourceInputs(args.problems, lambda: engine_completions(target()), Path(args.out), deadline)

    def build():
        exclude = frozenset().union(*(recipe_texts(r, args.problems) for r in excluded_recipes))
        return build_prompts(specs, args.seed, inputs, exclude)

    return prompt_set(args.out, recipe, build)


def main(argv=None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    deadline = None if args.time_budget_s is None else started + args.time_budget_s

    @cache
    def target():
        from specdec import LLM

        # the target alone: sampled answers reproduce from their seeds whatever drafter is shipped
        return LLM(args.target, None, device=args.device, dtype=args.dtype, max_num_seqs=args.batch_size,
                   num_kv_pages=args.num_kv_pages)

    try:
        prompts = load_or_build_prompts(args, target, deadline)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    if prompts is None:
        print("time budget: the self-instruct rounds are not finished; run the same command again to continue")
        return
    counts = Counter(p.domain for p in prompts)
    print(f"{args.out}: {len(prompts)} prompts ({', '.join(f'{d} {n}' for d, n in sorted(counts.items()))})")
    if args.prompts_only:
        return

    llm = target()
    end = len(prompts) if args.limit is None else min(len(prompts), args.start + args.limit)
    prompt_ids: list[list[int]] = [[] for _ in prompts]  # only the selected range is tokenized
    for i in range(args.start, end):
        prompt_ids[i] = llm.encode(prompts[i].text, chat=True)
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, greedy=not args.no_greedy,
                                  samples_per_problem=args.samples_per_problem, temperatures=args.temperature,
                                  top_p=args.top_p, seed=args.seed, shard_size=args.shard_size)
    metadata = {"target": str(args.target), "prompts": str(Path(args.out) / PROMPTS_FILE)}
    files = generate_shards(llm.engine, prompt_ids, args.out, settings, start=args.start, limit=args.limit,
                            metadata=metadata, deadline=deadline, domains=[p.domain for p in prompts])
    expected = -(-(end - args.start) // args.shard_size)
    if len(files) < expected:
        print(f"time budget: {len(files)} of {expected} shards finished; run the same command again to continue")
    if not files:
        return
    samples = load_samples(args.out)
    responses = samples.lengths - samples.prompt_lens.long()
    for domain, indices in samples.domain_indices().items():
        print(f"  {domain}: {len(indices)} samples, {int(responses[indices].sum())} response tokens")
    print(f"{args.out}: {len(samples)} samples, {int(samples.lengths.sum())} tokens, "
          f"{int(responses.sum())} response tokens")


if __name__ == "__main__":
    main()

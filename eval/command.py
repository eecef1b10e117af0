"""The command every problem set shares: `python -m eval.<name> [--limit N] [--baseline] ...`.

Runs the problems through the target (speculating when a drafter is given or shipped), grades each
response with the problem set's grader, and writes results.json, summary.md and
acceptance_histogram.png to --output. With --baseline the same prompts also run without the
drafter, for the speedup and a token-for-token comparison.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from specdec import LLM, SamplingParams
from specdec.arguments import add_engine_arguments, add_model_arguments, chosen_drafter, engine_options, revisions

from eval.chat_prompt import chat_prompt_ids
from eval.comparison import compare
from eval.problem_set import DataUnavailable, ProblemSet, select
from eval.report import summary_markdown, write_histogram_png, write_json
from eval.runner import Run, run_problems


def build_parser(problem_set: ProblemSet, prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog or f"python -m {problem_set.module}", description=problem_set.description,
                                epilog="--concurrency 1 (the default) is the z-lab batch-1 protocol.")
    add_model_arguments(p)
    # the engine's max_num_seqs is the eval's --concurrency: requests in flight, finished ones refilled at once
    add_engine_arguments(p, aliases={"max_num_seqs": ["--concurrency"]})
    p.set_defaults(max_num_seqs=1)
    p.add_argument("--data", default=None, help=problem_set.data_help)
    p.add_argument("--limit", type=int, default=None, help="a seeded random subset of N problems")
    p.add_argument("--seed", type=int, default=0, help="seed of the subset and of sampling")
    p.add_argument("--max-new-tokens", type=int, default=problem_set.default_max_new_tokens,
                   help="most tokens generated per problem")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--output", default=None, help=f"output directory (default: ./{problem_set.name}-<timestamp> "
                                                  "in the current directory)")
    p.add_argument("--baseline", action="store_true", help="also run without the drafter and compare")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(problem_set: ProblemSet, argv=None, prog: str | None = None) -> argparse.Namespace:
    p = build_parser(problem_set, prog)
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be positive")
    if args.max_num_seqs < 1:
        p.error("--concurrency must be positive")
    args.concurrency = args.max_num_seqs  # the eval's name for it, in results.json and the run protocol
    return args


def output_dir(args, problem_set: ProblemSet) -> Path:
    """--output, else <name>-<timestamp> in the current directory (never inside the repository's results/)."""
    return Path(args.output) if args.output else Path(f"{problem_set.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def check_output_dir(out: Path) -> bool:
    """Create `out` and prove it writable (by writing a file: access() passes for root on a read-only mount),
    before any model is loaded. Returns whether it was created here; raises OSError naming the path."""
    created = not out.exists()
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(20, "exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        if created:
            remove_if_empty(out)
        raise OSError(f"--output {out}: cannot write there ({err.strerror or err})") from None
    return created


def remove_if_empty(out: Path) -> None:
    try:
        out.rmdir()
    except OSError:
        pass


def make_llm(args, drafter) -> LLM:
    return LLM(args.target, drafter, chat_template=args.chat_template, **revisions(args), **engine_options(args))


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def release_memory(on_cuda: bool) -> None:
    """Return a dropped engine's memory before the next one is built (its KV pool is sized from free memory)."""
    import torch

    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()


def describe(problem_set: ProblemSet, args, argv, llm: LLM, drafter, problems, first_prompt: list[int]) -> dict:
    import torch
    import transformers

    engine = llm.engine
    return {
        "problem_set": problem_set.name,
        "command_line": shlex.join([Path(sys.executable).name, "-m", problem_set.module, *argv]),
        "target": str(args.target), "drafter": str(drafter) if drafter else None,
        "block_size": engine.drafter.block_size if engine.drafter is not None else None,
        "data": problem_set.data_label(args.data), "limit": args.limit, "seed": args.seed,
        "num_problems": len(problems), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "concurrency": args.concurrency, "kv_cache_dtype": args.kv_cache_dtype, "kv_dtype": str(engine.kv_dtype),
        "kv_full_precision_layers": list(engine.full_precision_layers), "drafter_kv_dtype": str(engine.drafter_kv_dtype),
        "verify": engine.config.verify, "cuda_graphs": engine.graph_capture_seconds is not None,
        "graph_capture_s": engine.graph_capture_seconds,
        "device": str(engine.device), "device_name": device_name(engine.device), "dtype": str(engine.dtype),
        "attention_backend": engine.backend_name, "num_kv_pages": engine.num_pages,
        "page_size": engine.pool.page_size, **problem_set.prompt_config,
        "first_prompt": llm.tokenizer.decode(first_prompt), "torch": torch.__version__,
        "transformers": transformers.__version__, "python": platform.python_version(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _prefixed(notes: dict, prefix: str) -> dict:
    return {prefix + key: value for key, value in notes.items()}


def problem_records(problem_set: ProblemSet, problems, main: Run, base: Run | None,
                    comparison: dict | None) -> list[dict]:
    differing = {d["index"]: d["first_diff"] for d in comparison["differing"]} if comparison else {}
    records = []
    for i, problem in enumerate(problems):
        result, graded = main.results[i], main.graded[i]
        record = {"index": problem.index, "id": problem.id, **problem_set.problem_fields(problem),
                  "extracted": graded.extracted, "correct": graded.correct, **graded.notes,
                  "tokens": len(result.token_ids), "tau": result.stats.tau, "tpot_s": result.stats.tpot,
                  "finish_reason": result.finish_reason, "error": result.error, "output": result.text}
        if base is not None:
            record.update(baseline_extracted=base.extracted[i], baseline_correct=base.correct[i],
                          **_prefixed(base.graded[i].notes, "baseline_"),
                          baseline_tokens=len(base.results[i].token_ids), identical=i not in differing,
                          first_diff=differing.get(i))
        records.append(record)
    return records


def load_inputs(problem_set: ProblemSet, args, out: Path) -> tuple[list, bool] | None:
    """The chosen problems and whether `out` was created here; None (after one `error:` line) when the
    data or `out` is unusable. Checked before any model is loaded, so that mistakes surface at once."""
    try:
        problems = select(problem_set.load(args.data), args.limit, args.seed)
        return problems, check_output_dir(out)
    except (DataUnavailable, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def write_files(problem_set: ProblemSet, out: Path, results: dict, main_run: Run) -> None:
    config = results["config"]
    write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary_markdown(results), encoding="utf-8")
    plotted = write_histogram_png(out / "acceptance_histogram.png", main_run.summary, config["block_size"] or 0,
                                  f"{problem_set.name}, {config['target']}, {config['num_problems']} problems")
    print(f"wrote {out}/results.json, summary.md" + (", acceptance_histogram.png" if plotted else ""),
          file=sys.stderr)


def main(problem_set: ProblemSet, argv=None, prog: str | None = None) -> int:
    """`prog` names the command in --help and usage errors (default `python -m eval.<name>`)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(problem_set, argv, prog)
    drafter = chosen_drafter(args)
    out = output_dir(args, problem_set)
    inputs = load_inputs(problem_set, args, out)
    if inputs is None:
        return 2
    problems, created = inputs
    try:
        llm = make_llm(args, drafter)
        prompts = [chat_prompt_ids(llm.tokenizer, problem_set.user_turn(p), problem_set.name) for p in problems]
        grader = problem_set.make_grader()
    except (DataUnavailable, ValueError, FileNotFoundError, ImportError) as err:
        if created:
            remove_if_empty(out)
        print(f"error: {err}", file=sys.stderr)
        return 2
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    config = describe(problem_set, args, argv, llm, drafter, problems, prompts[0])
    label = "speculative" if drafter else "autoregressive"
    progress = not args.no_progress

    def run(llm_, label_):
        return run_problems(llm_, problems, prompts, params, args.concurrency, grader, label_, progress,
                            title=problem_set.name)

    main_run = run(llm, label)
    print(f"{label}: {main_run.metric} {main_run.accuracy:.3f}\n{main_run.summary.format()}", file=sys.stderr)
    tokenizer = llm.tokenizer
    base, comparison = None, None
    if args.baseline and drafter is None:
        print("warning: --baseline ignored: the main run already has no drafter", file=sys.stderr)
    elif args.baseline:
        on_cuda = llm.engine.device.type == "cuda"
        del llm
        release_memory(on_cuda)
        base = run(make_llm(args, None), "baseline")
        comparison = compare(main_run, base, [p.id for p in problems], tokenizer)
        print(f"baseline: {base.metric} {base.accuracy:.3f}\n{base.summary.format()}\n"
              f"identical outputs {comparison['identical_fraction']:.3f}, speedup (TPOT) "
              f"{comparison['speedup_tpot'] or float('nan'):.2f}x", file=sys.stderr)
    results = {"config": config, "grader": grader.describe(), "main": main_run.as_dict(),
               "baseline": base.as_dict() if base else None, "comparison": comparison,
               "problems": problem_records(problem_set, problems, main_run, base, comparison)}
    write_files(problem_set, out, results, main_run)
    return 1 if main_run.errors == len(problems) else 0

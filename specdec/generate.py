"""Command line: `python -m specdec.generate [--target NAME|PATH] [--drafter NAME|PATH] --prompt TEXT ...`.

With no arguments it runs the default demo model (and its default drafter, when one exists)
on a built-in prompt. Text is streamed as it is produced; a stats line closes the run.
"""

from __future__ import annotations

import argparse
import logging
import sys

from specdec.llm import LLM
from specdec.model_arguments import add_model_arguments, chosen_drafter, engine_options
from specdec.sampling_params import SamplingParams

# the shipped drafter was trained on step-by-step math answers, so the demo asks for one
DEFAULT_PROMPT = ("A train travels 180 km in 2.5 hours and then 120 km in 1.5 hours. What is its average speed "
                  "for the whole trip?\nPlease reason step by step, and put your final answer within \\boxed{}.")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdec.generate", description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (default: on)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto")
    return p.parse_args(argv)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as err:
            raise SystemExit(f"error: cannot read --prompts-file: {err}") from err
    return prompts or [DEFAULT_PROMPT]


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                                chat=args.chat)
        prompts = read_prompts(args)
        drafter = chosen_drafter(args)
        llm = LLM(args.target, drafter, page_size=args.page_size, gpu_memory_utilization=args.gpu_memory_utilization,
                  attention_backend=args.attention_backend, **engine_options(args))
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    engine = llm.engine
    name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
    print(f"target {args.target} on {engine.device} ({name(engine.dtype)}, KV {name(engine.kv_dtype)}, "
          f"{engine.backend_name} attention, {engine.num_pages} pages of {engine.pool.page_size})"
          + (f", drafter {drafter} (block {engine.drafter.block_size})" if drafter else ", no drafter")
          + (f"; CUDA graphs captured in {engine.graph_capture_seconds:.1f} s"
             if engine.graph_capture_seconds is not None else ""),
          file=sys.stderr)
    stream = len(prompts) == 1
    on_text = (lambda i, text: print(text, end="", flush=True)) if stream else None
    results = llm.generate(prompts, params, on_text=on_text)
    for i, result in enumerate(results):
        if result.error:
            print(f"\n[request {i}] error: {result.error}", file=sys.stderr)
        elif not stream:
            print(f"\n===== [{i}] {result.finish_reason} =====\n{result.text}")
    print(f"\n\n{llm.last_summary.format()}", file=sys.stderr)
    return 1 if all(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

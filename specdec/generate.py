"""Command line: `python -m specdec.generate [--target NAME|PATH] [--drafter NAME|PATH] --prompt TEXT ...`.

With no arguments it runs the default demo model (and its default drafter, when one exists)
on a built-in prompt. Text is streamed as it is produced; a stats line closes the run.
Exit status: 0 done, 1 every request failed, 2 bad arguments or input, 130 interrupted (Ctrl-C),
141 stdout was closed (`... | head -1`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from specdec.llm import LLM
from specdec.engine.metrics import summarize
from specdec.arguments import (DefaultsHelpFormatter, add_engine_arguments, add_model_arguments, chosen_drafter,
                               engine_options, revisions)
from specdec.engine.sampling_params import SamplingParams

# the shipped drafter was trained on step-by-step math answers, so the demo asks for one
DEFAULT_PROMPT = ("A train travels 180 km in 2.5 hours and then 120 km in 1.5 hours. What is its average speed "
                  "for the whole trip?\nPlease reason step by step, and put your final answer within \\boxed{}.")
# long enough for the demo prompt's step-by-step answer to reach its \boxed{} (the library's default is 256)
DEFAULT_MAX_NEW_TOKENS = 512
PROG = "python -m specdec.generate"


class InputError(Exception):
    """Bad input found by the command line itself: printed as one `error:` line, exit status 2."""


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=DefaultsHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeat for a batch); None and no --prompts-file = the built-in demo prompt")
    p.add_argument("--prompts-file", default=None, help="a UTF-8 text file with one prompt per line")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the model's chat template (--no-chat for a model without one)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than this times the likeliest one (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (None = unseeded)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_arguments(p)
    return p


def parse_args(argv=None, prog: str = PROG) -> argparse.Namespace:
    return build_parser(prog).parse_args(argv)


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        name = args.prompts_file
        try:
            with open(name, "rb") as f:
                data = f.read()
        except OSError as err:
            raise InputError(f"cannot read --prompts-file {name}: {err.strerror or err}") from err
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"--prompts-file {name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
                             f"{err.start}); give a text file with one prompt per line") from err
        if "\x00" in text:
            raise InputError(f"--prompts-file {name} looks binary (it contains NUL bytes); give a text file with "
                             f"one prompt per line")
        lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]
        if not lines:
            raise InputError(f"--prompts-file {name} has no prompts (it is empty or blank); give one prompt per line")
        prompts += lines
    return prompts or [DEFAULT_PROMPT]


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def length_note(params: SamplingParams) -> str:
    return f"[stopped at --max-new-tokens {params.max_new_tokens}; raise it for a longer answer]"


def main(argv=None, prog: str = PROG) -> int:
    """`prog` names the command in --help and usage errors (`specdec generate` runs this too)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv, prog)
    try:
        return _run(args)
    except KeyboardInterrupt:  # before generation started (loading the model)
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of stdout has gone (`| head -1`): point stdout at devnull so that the interpreter's
    final flush cannot fail again (as the Python docs on SIGPIPE recommend), and exit quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file descriptor (tests)
        pass
    return 141


def _run(args) -> int:
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos, chat=args.chat)
        prompts = read_prompts(args)
        drafter = chosen_drafter(args)
        llm = LLM(args.target, drafter, chat_template=args.chat_template, **revisions(args), **engine_options(args))
    except (InputError, ValueError, FileNotFoundError, ImportError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    print(llm.describe(), file=sys.stderr)
    stream = len(prompts) == 1
    if stream:
        print(f"prompt: {prompts[0]}\n", file=sys.stderr, flush=True)
    on_text = (lambda i, text: print(text, end="", flush=True)) if stream else None
    start = time.perf_counter()
    try:
        results = llm.generate(prompts, params, on_text=on_text)
    except KeyboardInterrupt as err:
        return _interrupted(getattr(err, "partial_results", None) or [], len(prompts), params, stream,
                            time.perf_counter() - start)
    except ValueError as err:
        if getattr(err, "partial_results", None) is not None:  # failed mid-run: not bad input
            raise
        message = one_line(err)
        if "chat template" in message and args.chat:
            message += "; use --no-chat to send the prompt as plain text"
        print(f"error: {message}", file=sys.stderr)
        return 2
    _print_results(results, params, stream)
    print(f"\n\n{llm.last_summary.format()}", file=sys.stderr)
    return 1 if all(r.error for r in results) else 0


def _print_results(results, params: SamplingParams, stream: bool) -> None:
    for i, result in enumerate(results):
        if result.finish_reason == "abort":
            continue
        if result.error:
            print(f"\n[request {i}] error: {result.error}", file=sys.stderr)
        elif stream:
            if result.finish_reason == "length":
                sys.stdout.flush()
                print(f"\n{length_note(params)}", file=sys.stderr)
        else:
            note = f" {length_note(params)}" if result.finish_reason == "length" else ""
            print(f"\n===== [{i}] {result.finish_reason}{note} =====\n{result.text}")


def _interrupted(partial, num_prompts: int, params: SamplingParams, stream: bool, wall_time: float) -> int:
    """Ctrl-C during generation: what had finished, the stats of what was generated, a note; exit 130."""
    _print_results(partial, params, stream)
    summary = summarize([r.stats for r in partial if r.finish_reason != "error"], wall_time)
    finished = sum(r.finish_reason not in ("abort", "error") for r in partial)
    print(f"\n\n{summary.format()}", file=sys.stderr)
    print(f"interrupted (Ctrl-C): {finished} of {num_prompts} request(s) had finished; the stats above count "
          f"every token generated before the interrupt", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())

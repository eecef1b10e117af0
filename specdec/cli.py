"""The `specdec` command: `specdec generate|serve|eval|bench ...`, one subcommand per entry point.

A subcommand hands the rest of its command line to that entry point's own `main`, so `specdec serve ARGS`
is `python -m specdec.serve ARGS`: the same parser, flags, --help and exit status. Only the subcommand
that runs is imported, so `specdec --help` loads neither torch nor a model.
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# the benchmarks are scripts of the source checkout, not of the installed package: found beside it
CHECKOUT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Command:
    summary: str  # its line in the parent's --help
    run: Callable[[list[str], str], int]  # (the arguments after the subcommand, its name for --help) -> status


@dataclass(frozen=True)
class Group:
    summary: str
    commands: dict[str, Command | Group] = field(default_factory=dict)


def module_main(module: str) -> Callable[[list[str], str], int]:
    """Runs `module.main(argv, prog=...)`, importing the module only then."""
    return lambda argv, prog: importlib.import_module(module).main(argv, prog=prog)


def bench_script(name: str) -> Callable[[list[str], str], int]:
    return lambda argv, prog: run_script(CHECKOUT / "scripts" / f"bench_{name}.py", argv)


def run_script(script: Path, argv: list[str]) -> int:
    """`python SCRIPT ARGV` in this process. The script ends with sys.exit(main()), so its SystemExit
    (the exit status) passes through to the caller as it would from the script."""
    if not script.is_file():
        print(f"error: {script.name} is a script of the specdec source checkout, and there is none at {CHECKOUT} "
              f"(the installed package's parent); run it from a clone installed with `pip install -e .`",
              file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved
    return 0


SPECDEC = Group("speculative decoding with DFlash block drafting", {
    "generate": Command("generate text for prompts, streamed (python -m specdec.generate)",
                        module_main("specdec.generate")),
    "serve": Command("OpenAI-compatible HTTP server (python -m specdec.serve)", module_main("specdec.serve")),
    "eval": Group("accuracy and speed on a problem set", {
        "math500": Command("MATH-500 accuracy, speculative vs autoregressive (python -m eval.math500)",
                           module_main("eval.math500")),
        "humaneval": Command("HumanEval pass@1, speculative vs autoregressive (python -m eval.humaneval)",
                             module_main("eval.humaneval")),
    }),
    "bench": Group("benchmarks (scripts/bench_*.py of the source checkout)", {
        "steps": Command("where a decode step's time goes (scripts/bench_steps.py)", bench_script("steps")),
        "serve": Command("load generator for OpenAI-compatible servers (scripts/bench_serve.py)",
                         bench_script("serve")),
        "load": Command("throughput under load and the share of steps that prefill (scripts/bench_load.py)",
                        bench_script("load")),
        "peers": Command("side by side with vLLM, SGLang and transformers (scripts/bench_peers.py)",
                         bench_script("peers")),
    }),
})


def group_parser(group: Group, prog: str) -> argparse.ArgumentParser:
    """The parser of a group's own --help and usage errors; it lists the subcommands, one line each.
    Their flags are not declared here: each subcommand's parser is its entry point's. (The listing is
    written out rather than left to add_subparsers, whose --help misaligns a name of 9 or more letters.)"""
    width = max(map(len, group.commands)) + 2
    listing = "\n".join(f"  {name:<{width}}{entry.summary}" for name, entry in group.commands.items())
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} [-h] COMMAND ...", description=group.summary,
                                formatter_class=argparse.RawTextHelpFormatter,
                                epilog=f"commands:\n{listing}\n\n`{prog} COMMAND --help` shows that command's flags")
    p.add_argument("command", metavar="COMMAND", choices=list(group.commands), help="one of the commands below")
    return p


def dispatch(group: Group, argv: list[str], prog: str) -> int:
    if argv and argv[0] in group.commands:
        entry, name = group.commands[argv[0]], f"{prog} {argv[0]}"
        if isinstance(entry, Group):
            return dispatch(entry, argv[1:], name)
        return entry.run(argv[1:], name)
    group_parser(group, prog).parse_args(argv)  # exits: --help, or an error naming the valid commands
    return 2


def main(argv=None) -> int:
    return dispatch(SPECDEC, list(sys.argv[1:] if argv is None else argv), "specdec")


if __name__ == "__main__":
    sys.exit(main())

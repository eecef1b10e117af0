"""Host time per decode step from a cProfile profile: the functions with the most own time, and the project's with the
most time with their calls' included. cProfile's own cost per Python call inflates every row alike: compare rows,
not absolute times.

    python -m cProfile -o chain.prof -m eval.math500 --limit 6 --max-num-seqs 1 --output m-chain ...
    python -m scripts.bench.host_profile chain.prof --results m-chain/results.json     # per verify step
    python -m scripts.bench.host_profile chain.prof --steps 780 --top 30
"""

from __future__ import annotations

import argparse
import json
import pstats
import sys
from pathlib import Path

# the project's top-level folders: a profile made in another checkout (a device's copy of the tree) is read as well
PACKAGES = tuple(f"/{name}/" for name in ("specdec", "attention", "drafters", "eval", "scripts", "tests"))


def is_projects(file: str, exclude: str = "") -> bool:
    """Whether a profiled function's file is one of the project's (not an installed package's, nor `exclude`)."""
    return (any(name in file for name in PACKAGES) and file != exclude
            and "site-packages" not in file and "dist-packages" not in file)


def per_step(stats: dict, steps: int, top: int, exclude: str = "") -> dict:
    """From pstats' {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}: the `top` functions
    with the most own time (Python's and the C calls they make, such as a CUDA event's synchronize: blocking calls
    show as their wait) and the project's `top` with the most time inclusive of their calls, each [function, us per
    step, calls per step]."""
    ours = [item for item in stats.items() if is_projects(item[0][0], exclude)]

    def largest(items, column: int) -> list:
        items = sorted(items, key=lambda item: -item[1][column])[:top]
        return [[f"{Path(file).name}:{line}({name})", row[column] / steps * 1e6, row[1] / steps]
                for (file, line, name), row in items]

    return {"host_functions": largest(stats.items(), 2), "host_functions_inclusive": largest(ours, 3)}


def tables(functions: dict) -> list[str]:
    """The two lists as markdown tables."""
    lines = []
    for key, title in (("host_functions", "the functions with the most own host time per step (under cProfile)"),
                       ("host_functions_inclusive",
                        "the project's functions with the most host time per step, their calls' included")):
        lines += ["", title, "", "| function | us per step | calls per step |", "|---|---|---|"]
        lines += [f"| `{name}` | {us:.1f} | {count:.1f} |" for name, us, count in functions[key]]
    return lines


def verify_steps(results: Path) -> int:
    """The verify steps of an eval's run, from its results.json."""
    return json.loads(results.read_text())["main"]["summary"]["verify_steps"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", type=Path, help="a cProfile output file (python -m cProfile -o FILE ...)")
    steps = p.add_mutually_exclusive_group(required=True)
    steps.add_argument("--steps", type=int, help="the decode steps the profiled run made")
    steps.add_argument("--results", type=Path, help="an eval run's results.json: its verify steps")
    p.add_argument("--top", type=int, default=40, help="rows per list (default 40)")
    args = p.parse_args(argv)
    count = args.steps if args.steps is not None else verify_steps(args.results)
    if count <= 0:
        p.error(f"--steps must be positive, got {count}")
    functions = per_step(pstats.Stats(str(args.profile)).stats, count, args.top)
    print(f"{args.profile}: {count} steps")
    print("\n".join(tables(functions)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

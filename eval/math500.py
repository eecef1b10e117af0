"""math500 evaluation (the z-lab DFlash benchmark): `python -m eval.math500 [--limit N] [--baseline]`.

The MATH-500 problems (eval/problems.py), each asked to reason step by step and box its answer; the
last \\boxed{} of a response is graded against the gold answer (eval/grading.py). The command, its
flags and its files are shared with every problem set (eval/command.py).
"""

from __future__ import annotations

import sys

from eval import command
from eval.grading import select_grader
from eval.problems import HUB, INSTRUCTION, data_label, load_problems, user_turn
from eval.problem_set import ProblemSet

MATH500 = ProblemSet(
    name="math500",
    description=__doc__.splitlines()[0],
    default_max_new_tokens=2048,
    data_help=f"math500 jsonl (default: the 500 problems shipped in eval/data/; '{HUB}': the HuggingFaceH4/MATH-500 "
              "test split from the hub)",
    load=load_problems,
    data_label=data_label,
    user_turn=lambda problem: user_turn(problem.problem),
    make_grader=select_grader,
    problem_fields=lambda problem: {"subject": problem.subject, "level": problem.level, "answer": problem.answer},
    prompt_config={"prompt_instruction": INSTRUCTION},
)


def main(argv=None, prog: str | None = None) -> int:
    return command.main(MATH500, argv, prog)


if __name__ == "__main__":
    sys.exit(main())

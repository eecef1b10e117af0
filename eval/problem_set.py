"""What an evaluation needs to know about one set of problems, and what every set shares.

A `ProblemSet` says how its problems are loaded (the shipped copy or `--data`), the user turn of each
prompt, how a response is graded and which per-problem fields a report records. `eval.command` runs
any problem set the same way: subset, prompts through the chat template, one pass (and the baseline),
the files. `python -m eval.math500` and `python -m eval.humaneval` are two such definitions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


class DataUnavailable(RuntimeError):
    """The problems cannot be loaded; the message names the file (and line) or the missing package."""


@dataclass(frozen=True)
class Graded:
    extracted: str | None  # what was judged: the last \boxed{} content, the code that ran; None when nothing was
    correct: bool
    notes: dict = field(default_factory=dict)  # grader-specific per-problem record fields (e.g. the test outcome)


class Grader(Protocol):
    name: str  # recorded in results.json
    metric: str  # what the fraction of correct problems is called in reports: "accuracy", "pass@1"
    # graded after generation: None on the calling thread (math-verify's timeout is a SIGALRM handler, which only the
    # main thread may install), N on N threads (graders that run programs, each waiting on its subprocess)
    grading_threads: int | None

    def grade(self, problem, text: str) -> Graded: ...

    def describe(self) -> dict: ...


@dataclass(frozen=True)
class ProblemSet:
    name: str  # `python -m eval.<name>`, the default output directory's prefix, report titles
    description: str  # the command's one-line description
    default_max_new_tokens: int
    data_help: str  # --data's help text
    load: Callable[[str | None], list]  # --data (None: the shipped copy) -> problems; raises DataUnavailable
    data_label: Callable[[str | None], str]  # what results.json records as the data source
    user_turn: Callable[[Any], str]  # a problem -> the one user message of its prompt
    make_grader: Callable[[], Grader]
    problem_fields: Callable[[Any], dict]  # per-problem report fields besides index and id
    prompt_config: dict  # what results.json records about the prompt

    @property
    def module(self) -> str:
        return f"eval.{self.name}"


def select(problems: Sequence, limit: int | None, seed: int) -> list:
    """A seeded random subset of `limit` problems, kept in file order; all of them without a limit."""
    if limit is None or limit >= len(problems):
        return list(problems)
    chosen = random.Random(seed).sample(range(len(problems)), limit)
    return [problems[i] for i in sorted(chosen)]

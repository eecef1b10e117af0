"""The prompts of `scripts/bench_serve.py`: one user turn each, sent through /v1/chat/completions.

    math500  the 500 MATH-500 problems shipped in eval/data, each with the eval's instruction
             (`eval.problems.user_turn`), so that the server sees what `python -m eval.math500` sends
    code     everyday coding requests (code_requests.jsonl beside this file: write a function, fix a
             bug in given code, a SQL query, explain and implement, ...), written for this benchmark
    mixed    every code request and as many math500 problems (a seeded choice), so both kinds weigh
             the same

Each dataset is shuffled with the seed; a run of N requests takes the first N of that order, cycling
when N is larger, so that every server and every load level gets the same requests in the same order.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("math500", "code", "mixed")
CODE_REQUESTS = Path(__file__).with_name("code_requests.jsonl")


@dataclass(frozen=True)
class ChatPrompt:
    id: str  # "math500/<unique_id>" or "code/<id>"
    text: str  # the user turn


def math500_prompts() -> list[ChatPrompt]:
    from eval.problems import load_problems, user_turn

    return [ChatPrompt(f"math500/{p.id}", user_turn(p.problem)) for p in load_problems()]


def code_prompts(path: Path = CODE_REQUESTS) -> list[ChatPrompt]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [ChatPrompt(f"code/{row['id']}", row["request"]) for row in rows]


def load_prompts(dataset: str, seed: int) -> list[ChatPrompt]:
    """The dataset's prompts in its seeded order."""
    rng = random.Random(seed)
    if dataset == "math500":
        prompts = math500_prompts()
    elif dataset == "code":
        prompts = code_prompts()
    elif dataset == "mixed":
        code = code_prompts()
        prompts = code + rng.sample(math500_prompts(), len(code))
    else:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    rng.shuffle(prompts)
    return prompts


def take(prompts: list[ChatPrompt], count: int) -> list[ChatPrompt]:
    """The first `count` prompts, cycling through the list when it is shorter."""
    return list(itertools.islice(itertools.cycle(prompts), count))

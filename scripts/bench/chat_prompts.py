"""The prompts of `scripts/bench_serve.py`, sent through /v1/chat/completions: one user turn each, or
conversations (multiturn).

    math500  the 500 MATH-500 problems shipped in eval/data, each with the eval's instruction
             (`eval.problems.user_turn`), so that the server sees what `python -m eval.math500` sends
    code     everyday coding requests (code_requests.jsonl beside this file: write a function, fix a
             bug in given code, a SQL query, explain and implement, ...), written for this benchmark
    mixed    every code request and as many math500 problems (a seeded choice), so both kinds weigh
             the same
    multiturn conversations of 3-5 turns under one shared system prompt (system_prompt.txt beside this
             file): the first turn is a mixed prompt, each later turn a follow-up (`FOLLOW_UPS`) sent with
             the whole conversation so far once the previous answer has arrived, as chat clients do; what
             a prefix cache is for

Each dataset is shuffled with the seed; a run of N requests takes the first N of that order, cycling
when N is larger, so that every server and every load level gets the same requests in the same order.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("math500", "code", "mixed", "multiturn")
CODE_REQUESTS = Path(__file__).with_name("code_requests.jsonl")
SYSTEM_PROMPT = Path(__file__).with_name("system_prompt.txt")
FOLLOW_UPS = (
    "Explain the key step of your answer again, in two sentences.",
    "Check your answer: is there a mistake anywhere? Say where, or say it is right.",
    "Now give a shorter version of the answer.",
    "What would change if the input were twice as large?",
    "Write one test or check that would catch a wrong answer here.",
    "Give a second, different way to get the same result.",
    "Which part of this is easiest to get wrong, and why?",
    "Summarize everything so far in three bullet points.",
)


@dataclass(frozen=True)
class ChatPrompt:
    id: str  # "math500/<unique_id>" or "code/<id>" (multiturn: "multiturn/<n>/" and the first turn's id)
    text: str  # the (first) user turn
    follow_ups: tuple[str, ...] = ()  # multiturn: the user turns after the first, in order
    system: str | None = None  # multiturn: the system prompt every conversation shares


def math500_prompts() -> list[ChatPrompt]:
    from eval.problems import load_problems, user_turn

    return [ChatPrompt(f"math500/{p.id}", user_turn(p.problem)) for p in load_problems()]


def code_prompts(path: Path = CODE_REQUESTS) -> list[ChatPrompt]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [ChatPrompt(f"code/{row['id']}", row["request"]) for row in rows]


def system_prompt(repeat: int = 1) -> str:
    """The shared system prompt of the multiturn set, `repeat` copies of it (~500 tokens each: the long system
    prompts of agents and retrieval)."""
    return "\n\n".join([SYSTEM_PROMPT.read_text(encoding="utf-8").strip()] * repeat)


def conversations(first_turns: list[ChatPrompt], rng: random.Random, system_repeat: int = 1) -> list[ChatPrompt]:
    """Each first turn as a conversation of 3-5 turns under `system_prompt(system_repeat)`."""
    system = system_prompt(system_repeat)
    return [ChatPrompt(f"multiturn/{n}/{p.id}", p.text, tuple(rng.sample(FOLLOW_UPS, rng.randint(2, 4))), system)
            for n, p in enumerate(first_turns)]


def load_prompts(dataset: str, seed: int, system_repeat: int = 1) -> list[ChatPrompt]:
    """The dataset's prompts in its seeded order (multiturn: under `system_repeat` copies of the system prompt)."""
    rng = random.Random(seed)
    if dataset == "math500":
        prompts = math500_prompts()
    elif dataset in ("mixed", "multiturn"):
        code = code_prompts()
        prompts = code + rng.sample(math500_prompts(), len(code))
        if dataset == "multiturn":
            prompts = conversations(prompts, rng, system_repeat)
    elif dataset == "code":
        prompts = code_prompts()
    else:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    rng.shuffle(prompts)
    return prompts


def take(prompts: list[ChatPrompt], count: int) -> list[ChatPrompt]:
    """The first `count` prompts, cycling through the list when it is shorter."""
    return list(itertools.islice(itertools.cycle(prompts), count))

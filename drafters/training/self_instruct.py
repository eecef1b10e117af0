"""Requests written by the target itself (self-instruct): for every seed topic of `topics.json` the
target, sampling, writes a numbered list of new coding requests or general instructions; the lists
are split into requests, filtered and deduplicated (exact and near-duplicate, `near_duplicates`).

Work goes in rounds, one sampled answer per seed topic each, with a seed per (round, topic), so the
result does not depend on batching; rounds run until enough distinct requests are found. Each
round's raw answers are stored in `cache_dir`, so an interrupted build resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from drafters.training.general_tasks import topics
from drafters.training.near_duplicates import unique_texts
from specdec.engine.sampling_params import SamplingParams

# (prompts, seeds) -> the target's answers, one per prompt
Completions = Callable[[list[str], list[int]], list[str]]

REQUESTS_PER_ANSWER = 8
MIN_CHARS, MAX_CHARS = 20, 1000
INSTRUCTIONS = {
    "code": "Write {n} different requests that programmers might send to an AI coding assistant about {topic}. "
            "Make each one concrete and self-contained (include any code or data it refers to), and vary the kind "
            "of task: write new code, fix a bug, explain, refactor, test, design. Number them 1 to {n}, one per "
            "line, and write only the requests, not their answers.",
    "general": "Write {n} different questions or instructions that people might send to an AI assistant about "
               "{topic}. Make each one specific and self-contained, and vary the kind of request: explain, advise, "
               "compare, plan, write, summarize. Number them 1 to {n}, one per line, and write only the requests, "
               "not their answers.",
}
NUMBERED_LINE = re.compile(r"^\s*(?:\*\*)?\d{1,2}[.)]\s*(?:\*\*)?\s*(.+?)\s*$")


def topic_prompts() -> list[str]:
    """One writing instruction per seed topic: coding topics first, then general ones."""
    seeds = topics()["self_instruct"]
    return [INSTRUCTIONS[kind].format(n=REQUESTS_PER_ANSWER, topic=topic) for kind in ("code", "general")
            for topic in seeds[kind]]


def parse_requests(answer: str) -> list[str]:
    """The numbered items of a list (`1. ...`, `2) ...`, bold numbers too), quotes and markup stripped."""
    found = []
    for line in answer.splitlines():
        match = NUMBERED_LINE.match(line)
        if match:
            text = match.group(1).strip().strip('"“”').strip("*").strip()
            if MIN_CHARS <= len(text) <= MAX_CHARS:
                found.append(text)
    return found


def round_seed(seed: int, round_index: int, topic_index: int) -> int:
    return (seed * 1_000_003 + round_index) * 100_000 + topic_index


def round_path(cache_dir: Path, round_index: int) -> Path:
    return cache_dir / f"selfinstruct-round-{round_index:03d}.json"


def answers_of_round(complete: Completions, prompts: list[str], seed: int, round_index: int,
                     cache_dir: Path) -> list[str]:
    """The round's answers, from its file when an earlier run wrote it."""
    path = round_path(cache_dir, round_index)
    if path.is_file():
        return json.loads(path.read_text())
    answers = complete(prompts, [round_seed(seed, round_index, i) for i in range(len(prompts))])
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps(answers))
    os.replace(tmp, path)
    return answers


def self_instruct_prompts(count: int, seed: int, complete: Completions, cache_dir: str | os.PathLike,
                          deadline: float | None = None, max_rounds: int | None = None) -> list[str] | None:
    """Up to `count` distinct target-written requests; None when `deadline` (a time.monotonic()
    value) passed before enough rounds ran (the rounds done so far are kept for the next call)."""
    prompts = topic_prompts()
    if max_rounds is None:  # enough for one usable request per four asked, at least four rounds
        max_rounds = max(4, 4 * math.ceil(count / (len(prompts) * REQUESTS_PER_ANSWER)))
    requests: list[str] = []
    kept: list[int] = []
    longest = 0.0
    for round_index in range(max_rounds):
        cached = round_path(Path(cache_dir), round_index).is_file()
        if deadline is not None and not cached and time.monotonic() + 1.2 * longest > deadline:
            return None
        started = time.monotonic()
        answers = answers_of_round(complete, prompts, seed, round_index, Path(cache_dir))
        longest = max(longest, 0.0 if cached else time.monotonic() - started)
        requests += [r for answer in answers for r in parse_requests(answer)]
        kept = unique_texts(requests)
        if len(kept) >= count:
            break
    return [requests[i] for i in kept[:count]]


def engine_completions(llm, max_new_tokens: int = 768, temperature: float = 1.0, top_p: float = 0.95) -> Completions:
    """Completions from a `specdec.LLM`: chat-formatted user turns, one seeded sampled request each."""

    def complete(prompts: list[str], seeds: list[int]) -> list[str]:
        requests = [llm.engine.make_request(llm.encode(p, chat=True), SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=s)) for p, s in zip(prompts, seeds)]
        llm.engine.run(requests)
        return [llm.tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in requests]

    return complete

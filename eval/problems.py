"""math500 problems: loading (hub or a local jsonl), seeded subsets and the z-lab prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

HUB_DATASET = "HuggingFaceH4/MATH-500"
OFFLINE_HINT = "--data ../shared/data/math500.jsonl"
# the z-lab benchmark's user turn, appended to every problem (no system prompt of our own)
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


class DataUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Problem:
    index: int  # position in the data file
    id: str  # unique_id when the data has one, else the index
    problem: str
    answer: str
    subject: str | None = None
    level: int | None = None


def _read_jsonl(path: str) -> list[dict]:
    import json

    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _rows(data: str | None) -> list[dict]:
    """Rows of the hub's test split (data None) or of a local jsonl. Without the `datasets` package
    (e.g. a bare GPU image) a local jsonl is read directly."""
    if data is not None and not Path(data).is_file():
        raise DataUnavailable(f"--data {data}: no such file")
    try:
        import datasets
    except ImportError:
        if data is None:
            raise DataUnavailable(f"the `datasets` package is needed for the hub split; use {OFFLINE_HINT}")
        return _read_jsonl(data)
    if data is not None:
        return list(datasets.load_dataset("json", data_files=str(data), split="train"))
    try:
        return list(datasets.load_dataset(HUB_DATASET, split="test"))
    except Exception as err:  # offline machines raise ConnectionError, OSError or hub-specific errors
        raise DataUnavailable(f"cannot load {HUB_DATASET} from the Hugging Face hub ({err}); "
                              f"use a local copy, e.g. {OFFLINE_HINT}") from err


def load_problems(data: str | None = None) -> list[Problem]:
    """Every problem in file order: `data` is a local jsonl path, None means the hub's test split."""
    rows = _rows(data)
    missing = {"problem", "answer"} - set(rows[0] if rows else ())
    if missing:
        raise DataUnavailable(f"the data has no {', '.join(sorted(missing))} field(s)")
    return [Problem(i, str(row.get("unique_id") or i), row["problem"], str(row["answer"]), row.get("subject"),
                    row.get("level")) for i, row in enumerate(rows)]


def select(problems: list[Problem], limit: int | None, seed: int) -> list[Problem]:
    """A seeded random subset of `limit` problems, kept in file order; all of them without a limit."""
    if limit is None or limit >= len(problems):
        return list(problems)
    chosen = random.Random(seed).sample(range(len(problems)), limit)
    return [problems[i] for i in sorted(chosen)]


def prompt_ids(tokenizer, problem: str) -> list[int]:
    """Token ids of the chat prompt for one problem, built here so that the exact prompt is known.

    The message list holds only the user turn, as z-lab does; a template that adds its own default
    system prompt (Qwen2.5) therefore keeps it. Thinking is switched off where the template has the
    switch (Qwen3)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the target's tokenizer has no chat template; math500 prompts need one")
    options = {"enable_thinking": False} if "enable_thinking" in str(template) else {}
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem + INSTRUCTION}], tokenize=False,
                                         add_generation_prompt=True, **options)
    # the template already wrote any BOS / special tokens it wants
    return tokenizer.encode(text, add_special_tokens=False)

"""math500 problems: loading (the shipped copy, a local jsonl or the hub), seeded subsets and the z-lab prompt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

HUB_DATASET = "HuggingFaceH4/MATH-500"
HUB = "hub"  # `--data hub`: the hub's test split through `datasets` (opt-in; the shipped copy is the default)
# the same 500 problems (the hub's test split, same fields), shipped with the package for offline use
PACKAGED_DATA = Path(__file__).parent / "data" / "math500.jsonl"
REQUIRED = ("problem", "answer")
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


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataUnavailable(f"{where}: not a JSON object (a {type(row).__name__})")
    missing = [k for k in REQUIRED if k not in row or row[k] is None]
    if missing:
        raise DataUnavailable(f"{where}: missing field(s) {', '.join(missing)} (each line needs "
                              f"{' and '.join(REQUIRED)})")
    empty = [k for k in REQUIRED if not str(row[k]).strip()]
    if empty:
        raise DataUnavailable(f"{where}: empty field(s) {', '.join(empty)}")
    return row


def _read_jsonl(path: str) -> list[dict]:
    """The rows of a jsonl file, each checked: the first bad line is reported as `path:line: what`."""
    import json

    p = Path(path)
    if not p.exists():
        raise DataUnavailable(f"{path}: no such file")
    if not p.is_file():
        raise DataUnavailable(f"{path}: not a file")
    rows = []
    try:
        with open(p, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataUnavailable(f"{path}:{number}: not a JSON line ({err.msg}, column {err.colno})") from None
                rows.append(_check_row(row, f"{path}:{number}"))
    except UnicodeDecodeError as err:
        raise DataUnavailable(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise DataUnavailable(f"{path}: cannot read ({err.strerror or err})") from None
    if not rows:
        raise DataUnavailable(f"{path}: holds no problems (empty file)")
    return rows


def _hub_rows() -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise DataUnavailable("--data hub needs the `datasets` package; without --data the shipped copy "
                              "is used") from None
    try:
        rows = list(datasets.load_dataset(HUB_DATASET, split="test"))
    except Exception as err:  # offline machines raise ConnectionError, OSError or hub-specific errors
        raise DataUnavailable(f"cannot load {HUB_DATASET} from the Hugging Face hub ({err}); run without --data "
                              f"for the shipped copy") from err
    if not rows:
        raise DataUnavailable(f"{HUB_DATASET} (test split): holds no problems")
    return [_check_row(row, f"{HUB_DATASET} (test split) row {i}") for i, row in enumerate(rows)]


def data_label(data: str | None) -> str:
    """What results.json records as the data source."""
    if data == HUB:
        return f"{HUB_DATASET} (test, hub)"
    return str(data) if data is not None else f"{HUB_DATASET} (test, shipped copy)"


def load_problems(data: str | None = None) -> list[Problem]:
    """Every problem in file order. `data`: a local jsonl path; None, the copy shipped in eval/data/;
    "hub", the hub's test split (needs `datasets` and a network). Local files are read without `datasets`.
    Raises DataUnavailable naming the file and line of the first malformed row."""
    rows = _hub_rows() if data == HUB else _read_jsonl(str(PACKAGED_DATA) if data is None else data)
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

"""math500 problems: loading (the shipped copy, a local jsonl or the hub) and the z-lab prompt.

`select` and `DataUnavailable` (shared by every problem set, `eval.problem_set`) stay importable from
here with the rest of the math500 data API that scripts/bench_peers.py uses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eval.chat_prompt import chat_prompt_ids
from eval.data_file import check_row, read_rows
from eval.problem_set import DataUnavailable, select

__all__ = ["HUB", "INSTRUCTION", "PACKAGED_DATA", "DataUnavailable", "Problem", "data_label", "load_problems",
           "prompt_ids", "select", "user_turn"]

HUB_DATASET = "HuggingFaceH4/MATH-500"
HUB = "hub"  # `--data hub`: the hub's test split through `datasets` (opt-in; the shipped copy is the default)
# the same 500 problems (the hub's test split, same fields), shipped with the package for offline use
PACKAGED_DATA = Path(__file__).parent / "data" / "math500.jsonl.gz"
REQUIRED = ("problem", "answer")
# the z-lab benchmark's user turn, appended to every problem (no system prompt of our own)
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Problem:
    index: int  # position in the data file
    id: str  # unique_id when the data has one, else the index
    problem: str
    answer: str
    subject: str | None = None
    level: int | None = None


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
    return [check_row(row, f"{HUB_DATASET} (test split) row {i}", REQUIRED) for i, row in enumerate(rows)]


def data_label(data: str | None) -> str:
    """What results.json records as the data source."""
    if data == HUB:
        return f"{HUB_DATASET} (test, hub)"
    return str(data) if data is not None else f"{HUB_DATASET} (test, shipped copy)"


def load_problems(data: str | None = None) -> list[Problem]:
    """Every problem in file order. `data`: a local jsonl path; None, the copy shipped in eval/data/;
    "hub", the hub's test split (needs `datasets` and a network). Local files are read without `datasets`.
    Raises DataUnavailable naming the file and line of the first malformed row."""
    rows = _hub_rows() if data == HUB else read_rows(str(PACKAGED_DATA) if data is None else data, REQUIRED)
    return [Problem(i, str(row.get("unique_id") or i), row["problem"], str(row["answer"]), row.get("subject"),
                    row.get("level")) for i, row in enumerate(rows)]


def user_turn(problem: str) -> str:
    return problem + INSTRUCTION


def prompt_ids(tokenizer, problem: str) -> list[int]:
    """Token ids of the z-lab chat prompt for one problem (`eval.chat_prompt`)."""
    return chat_prompt_ids(tokenizer, user_turn(problem), "math500")

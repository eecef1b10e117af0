"""A problems file: the rows of a jsonl file (gzip-compressed when its name ends in .gz), each checked
for the fields a problem set needs, so that the first bad line is reported as `path:line: what`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from eval.problem_set import DataUnavailable


def check_row(row, where: str, required: tuple[str, ...]) -> dict:
    if not isinstance(row, dict):
        raise DataUnavailable(f"{where}: not a JSON object (a {type(row).__name__})")
    missing = [k for k in required if k not in row or row[k] is None]
    if missing:
        raise DataUnavailable(f"{where}: missing field(s) {', '.join(missing)} (each line needs "
                              f"{' and '.join(required)})")
    empty = [k for k in required if not str(row[k]).strip()]
    if empty:
        raise DataUnavailable(f"{where}: empty field(s) {', '.join(empty)}")
    return row


def _open_text(p: Path):
    if p.name.endswith(".gz"):
        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def read_rows(path: str, required: tuple[str, ...]) -> list[dict]:
    """The rows of a jsonl file in file order, each a JSON object with non-empty `required` fields."""
    p = Path(path)
    if not p.exists():
        raise DataUnavailable(f"{path}: no such file")
    if not p.is_file():
        raise DataUnavailable(f"{path}: not a file")
    rows = []
    try:
        with _open_text(p) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataUnavailable(f"{path}:{number}: not a JSON line ({err.msg}, column {err.colno})") from None
                rows.append(check_row(row, f"{path}:{number}", required))
    except UnicodeDecodeError as err:
        raise DataUnavailable(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except (gzip.BadGzipFile, EOFError) as err:
        raise DataUnavailable(f"{path}: not a readable gzip file ({err})") from None
    except OSError as err:
        raise DataUnavailable(f"{path}: cannot read ({err.strerror or err})") from None
    if not rows:
        raise DataUnavailable(f"{path}: holds no problems (empty file)")
    return rows

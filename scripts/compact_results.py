"""Rewrite result archives (tar.xz) compactly, so that raw results stay small enough to keep in git:

    python scripts/compact_results.py results/NAME.tar.xz [...]      # in place

- plots (.png) are left out: `scripts/plot_training_log.py` and the evals' reports draw them again from the training
  logs and results kept beside them;
- every float of a JSON (or JSON lines) file is rounded to 6 significant digits, never coarser than a thousandth
  (unix times keep their milliseconds): finer digits are below what a run measures, and they compress worst;
- a progress bar's lines in a log are left out, with the frames it wrote over each other (carriage returns): they
  time the bar (model loading, conversion), not what the run measured;
- files compressed inside the archive (.gz, .xz) are stored plain, under their names without that suffix, so that
  the archive's own compression covers them with everything else; a tar inside is compacted likewise.

Members keep their order, times and (but for that suffix) names. The archive is compressed with xz -9e.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import lzma
import math
import re
import sys
import tarfile
from pathlib import Path

XZ = dict(preset=9 | lzma.PRESET_EXTREME)


def rounded(value):
    """`value` (JSON data) with each float to 6 significant digits, or to a thousandth where that is finer."""
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return value
        whole_digits = math.floor(math.log10(abs(value))) + 1
        return float(f"{value:.{max(6, whole_digits + 3)}g}")
    if isinstance(value, list):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    return value


def compact_json(data: bytes, lines: bool) -> bytes:
    """A JSON (or JSON lines) file with its floats rounded, laid out as before (indented or not); as it was where it
    does not parse."""
    try:
        text = data.decode("utf-8")
        if lines:
            return "\n".join(json.dumps(rounded(json.loads(line))) if line.strip() else line
                             for line in text.split("\n")).encode()
        indent = 1 if text[:2] in ("{\n", "[\n") else None
        return (json.dumps(rounded(json.loads(text)), indent=indent) + ("\n" if text.endswith("\n") else "")).encode()
    except ValueError:  # (UnicodeDecodeError and json's errors are ValueErrors)
        return data


# a tqdm bar's frame: "desc:  50%|#####     | 4/9 [00:01<00:01, 3.2it/s]", its bar and times optional
PROGRESS_BAR = re.compile(rb"\d+%\|.*\| *\d+/\d+")


def without_progress_bars(log: bytes) -> bytes:
    """A log's lines as a terminal leaves them (of the frames written over each other, the last), progress bars left
    out."""
    lines = []
    for line in log.split(b"\n"):
        frames = [frame for frame in line.split(b"\r") if frame.strip()]
        last = frames[-1] if frames else line.replace(b"\r", b"")
        if not PROGRESS_BAR.search(last):
            lines.append(last)
    return b"\n".join(lines)


def compact_file(name: str, data: bytes) -> tuple[str, bytes]:
    """A member's name and contents, compacted."""
    if name.endswith((".gz", ".xz")):
        data = gzip.decompress(data) if name.endswith(".gz") else lzma.decompress(data)
        name = name[:-3]
    if name.endswith(".tar"):
        return name, compact_tar(io.BytesIO(data))
    if name.endswith((".json", ".jsonl")):
        return name, compact_json(data, name.endswith(".jsonl"))
    if name.endswith((".log", ".txt", ".md", ".err")) and (b"\r" in data or PROGRESS_BAR.search(data)):
        return name, without_progress_bars(data)
    return name, data


def compact_tar(source) -> bytes:
    """An uncompressed tar of the members of the tar in file object `source` (compressed or not), compacted."""
    out = io.BytesIO()
    with tarfile.open(fileobj=source) as old, tarfile.open(fileobj=out, mode="w", format=old.format) as new:
        for member in old.getmembers():
            if member.name.endswith(".png"):
                continue
            if not member.isfile():
                new.addfile(member)
                continue
            member.name, data = compact_file(member.name, old.extractfile(member).read())
            member.size = len(data)
            new.addfile(member, io.BytesIO(data))
    return out.getvalue()


def compact_archive(path: Path) -> tuple[int, int]:
    """Rewrite the archive at `path` in place; returns its size before and after."""
    before = path.stat().st_size
    with path.open("rb") as f:
        data = lzma.compress(compact_tar(f), **XZ)
    path.write_bytes(data)
    return before, len(data)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archives", nargs="+", type=Path, help="tar.xz files, rewritten in place")
    args = p.parse_args(argv)
    for path in args.archives:
        before, after = compact_archive(path)
        print(f"{path}: {before:,} -> {after:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""scripts/compact_results.py: a result archive rewritten compactly keeps every member's data but plots, progress
bars and digits below a millionth of a value (or a thousandth)."""

import gzip
import io
import json
import lzma
import tarfile

from scripts.compact_results import compact_archive, rounded


def archive(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))


def members(path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_floats_keep_six_significant_digits_and_never_less_than_a_thousandth():
    assert rounded(3.7247074950000183) == 3.72471
    assert rounded(0.000123456789) == 0.000123457
    assert rounded(1796534212.425572) == 1796534212.426  # a unix time keeps its milliseconds
    assert rounded({"a": [1, 2.5, None, "x", float("inf"), 0.0, True]}) == {"a": [1, 2.5, None, "x", float("inf"), 0.0,
                                                                                 True]}


def test_an_archive_is_rewritten_compactly_and_keeps_its_members_in_order(tmp_path):
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tar:
        data = json.dumps({"t": 0.123456789}).encode()
        info = tarfile.TarInfo("inner/a.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "run.tar.xz"
    archive(path, {
        "run/results.json": json.dumps({"tokens_per_s": 439.7660761815048, "steps": [[0, 64, 2.2680791]]},
                                       indent=1).encode(),
        "run/log.jsonl": b'{"step": 1, "loss": 2.345678901}\n{"step": 2, "loss": 1.0}\n',
        "run/curves.png": b"\x89PNG" + bytes(200),
        "run/run.log": b"start\nconvert:   0%|  | 0/9\rconvert:  50%|# | 4/9\rconvert: 100%|##| 9/9\ndone\n"
                      b"Loading weights: 100%|##########| 51/51 [00:00<00:00, 4574.63it/s]\nok 100% | 2/2 |\n",
        "run/gpu-all.log.gz": gzip.compress(b"145 passed\n"),
        "run/load.json.xz": lzma.compress(b'{"x": 1.23456789}'),
        "run/json.tar": inner.getvalue(),
        "run/notes.md": b"| a | b |\n",
    })
    compact_archive(path)
    got = members(path)
    assert list(got) == ["run/results.json", "run/log.jsonl", "run/run.log", "run/gpu-all.log", "run/load.json",
                         "run/json.tar", "run/notes.md"]
    assert json.loads(got["run/results.json"]) == {"tokens_per_s": 439.766, "steps": [[0, 64, 2.26808]]}
    assert got["run/results.json"].startswith(b"{\n")  # still indented
    assert got["run/log.jsonl"] == b'{"step": 1, "loss": 2.34568}\n{"step": 2, "loss": 1.0}\n'
    assert got["run/run.log"] == b"start\ndone\nok 100% | 2/2 |\n"  # (a table's cells are no bar)
    assert got["run/gpu-all.log"] == b"145 passed\n"
    assert json.loads(got["run/load.json"]) == {"x": 1.23457}
    assert json.loads(members_of_tar(got["run/json.tar"])["inner/a.json"]) == {"t": 0.123457}
    assert got["run/notes.md"] == b"| a | b |\n"
    with tarfile.open(path) as tar:
        assert {m.mtime for m in tar.getmembers()} == {1_700_000_000}


def members_of_tar(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_a_file_that_does_not_parse_is_kept_as_it_was(tmp_path):
    path = tmp_path / "run.tar.xz"
    archive(path, {"run/partial.json": b'{"rows": [1.23456789', "run/bytes.json": b"\xff\xfe"})
    compact_archive(path)
    assert members(path) == {"run/partial.json": b'{"rows": [1.23456789', "run/bytes.json": b"\xff\xfe"}

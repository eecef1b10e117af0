"""scripts/bench_load.py: every concurrency delivers every request's tokens, and its step accounting adds up."""

import json

from scripts.bench_load import main


def test_quick_run_reports_every_system_and_concurrency(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [("AR", 1), ("AR", 4), ("DFlash", 1), ("DFlash", 4)]
    for row in rows:
        assert 0 < row["tokens"] <= row["requests"] * 8
        assert row["prefill_steps"] >= 1 and row["decode_steps"] >= 1
        assert 0 < row["prefill_share"] < 1 and row["decode_batch"] <= row["concurrency"]
        assert (row["tau"] is None) == (row["system"] == "AR")
    assert "| DFlash | 4 |" in capsys.readouterr().out

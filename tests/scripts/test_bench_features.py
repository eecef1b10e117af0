"""scripts/bench_features.py on a tiny random model: every feature at every concurrency, logprobs given."""

import json

from scripts import bench_features


def test_quick_run_reports_each_feature_at_each_concurrency(tmp_path, capsys):
    out = tmp_path / "features.json"
    assert bench_features.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["feature"]) for r in rows] == [
        (c, f) for c in (1, 4) for f in ("plain", "logprobs", "penalties")]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "| 4 | logprobs |" in capsys.readouterr().out

"""scripts/kv_precision.py runs end to end on a tiny model and writes one row per layer."""

import json

from scripts.kv_precision import main


def test_quick_run_writes_every_layer(tmp_path, capsys):
    out = tmp_path / "kv.json"
    assert main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["layers"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert all(0 <= r["bf16"] < r["fp8"] for r in rows)
    assert "| layer |" in capsys.readouterr().out

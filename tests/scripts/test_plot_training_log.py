"""scripts/plot_training_log.py: runs laid end to end on the step axis, per-domain series."""

import json

import pytest

from scripts.plot_training_log import curves, main, read_log
from tests.eval_helpers import importable


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def record(step, code_tau, math_tau):
    return {"step": step, "loss": 1.0, "eval_loss": 2.0, "tau_estimate": (code_tau + math_tau) / 2,
            "domains": {"code": {"eval_loss": 3.0, "tau_estimate": code_tau, "sequences": 4},
                        "math": {"eval_loss": 1.5, "tau_estimate": math_tau, "sequences": 4}}}


def test_later_runs_continue_the_step_axis(tmp_path):
    first = write_log(tmp_path / "a.jsonl", [record(500, 2.0, 3.5), record(1000, 2.2, 3.7)])
    later = record(500, 2.5, 3.9)
    later["domains"]["code"]["decode_tau_estimate"] = 1.9  # logged since the decoding estimate exists
    second = write_log(tmp_path / "b.jsonl", [{"step": 10, "loss": 1.0}, later])
    points, starts = curves([read_log(first), read_log(second)])
    assert starts == [1000]
    assert points["code"] == [(500, 2.0, 3.0, None), (1000, 2.2, 3.0, None), (1500, 2.5, 3.0, 1.9)]
    assert [p[0] for p in points["math"]] == [500, 1000, 1500]


def test_a_log_without_domains_is_one_series(tmp_path):
    log = write_log(tmp_path / "a.jsonl", [{"step": 200, "loss": 1.0, "eval_loss": 2.5, "tau_estimate": 3.0}])
    points, starts = curves([read_log(log)])
    assert points == {"all": [(200, 3.0, 2.5, None)]} and starts == []


def test_logs_without_evaluations_are_refused(tmp_path):
    log = write_log(tmp_path / "a.jsonl", [{"step": 10, "loss": 1.0}])
    with pytest.raises(SystemExit, match="no evaluation records"):
        main([str(log), "--out", str(tmp_path / "c.png")])


@pytest.mark.skipif(not importable("matplotlib"), reason="needs matplotlib")
def test_writes_the_figure(tmp_path):
    log = write_log(tmp_path / "a.jsonl", [record(500, 2.0, 3.5), record(1000, 2.2, 3.7)])
    main([str(log), str(log), "--out", str(tmp_path / "c.png")])
    assert (tmp_path / "c.png").stat().st_size > 1000

"""scripts/bench_budget_shares.py: a CPU smoke run, and its offline table on request steps whose outcome is known."""

import numpy as np

from scripts.bench_budget_shares import main, shares_table


def test_quick_run_records_every_request_step(tmp_path, capsys):
    out = tmp_path / "shares.npz"
    assert main(["--quick", "--out", str(out)]) == 0
    data = np.load(out)
    assert data["confidence"].shape[0] == data["accepted"].shape[0] > 0
    assert (data["confidence"] <= 0).all() and (data["accepted"] >= 0).all()
    # each request step's own confidences (not every row the drafter's last buffer)
    assert len(np.unique(data["confidence"], axis=0)) > data["confidence"].shape[0] // 2
    assert "| rows a request | chain | budget, blocks of" in capsys.readouterr().out


def test_budgets_give_the_rows_to_the_drafts_that_are_kept():
    """Half the requests are sure of their drafts and keep all seven, half unsure and keep none: a budget of two rows
    a request gives the sure ones the unsure ones' rows (3 tokens and 1), where a chain of two gives every request
    one draft (2 and 1). In blocks of 4 a sure request verifies at most 3 drafts, so at three rows a request the rows
    it cannot take go to the unsure ones (4 tokens and 1, where whole blocks give 5 and 1)."""
    confidence = np.concatenate([np.full((8, 7), -0.01), np.full((8, 7), -5.0)]).astype(np.float32)
    accepted = np.array([7] * 8 + [0] * 8)
    rows = {line.split("|")[1].strip(): line for line in shares_table(confidence, accepted, 16).splitlines()
            if line.startswith("| ")}
    assert rows["2"] == "| 2 | 1.500 | 2.000 | 2.000 |"
    assert rows["3"] == "| 3 | 2.000 | 3.000 | 2.500 |"
    assert rows["4"] == "| 4 | 2.500 | 4.000 | - |"

"""scripts/bench_prefix_ttft.py on a tiny random model: later conversations find the system prompt cached,
turn 2 finds turn 1, and the cache-off run finds nothing."""

import json

from scripts import bench_prefix_ttft


def test_quick_run_times_both_turns_with_and_without_the_cache(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    assert bench_prefix_ttft.main(["--quick", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    turn1, turn2 = run["cache"]["prompt_tokens"]
    assert turn2 > turn1 > 0
    assert run["cache"]["turn1"]["cached_tokens"] > 0  # the shared system prompt
    assert run["cache"]["turn2"]["cached_tokens"] >= turn1 // 16 * 16 - 16
    assert all(run["no_cache"][t]["cached_tokens"] == 0 and run["no_cache"][t]["ms"] > 0 for t in ("turn1", "turn2"))
    assert "| turn 2 |" in capsys.readouterr().out


def test_profile_reports_each_turn_and_the_host_functions_of_turn_two(tmp_path, capsys):
    out = tmp_path / "ttft.json"
    assert bench_prefix_ttft.main(["--quick", "--profile", "2", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    profile = run["profile"]
    assert profile["turns"] == 2
    for turn in ("turn1", "turn2"):
        assert profile[turn]["wall_ms"] > 0 and profile[turn]["gpu_busy_ms"] >= 0  # no GPU: nothing busy
    assert "engine.py" in profile["turn2_host_functions"]  # the engine's step, listed by cProfile
    assert "turn 2 host functions" in capsys.readouterr().out

"""scripts/bench/host_profile.py: host time per step from a saved cProfile profile, steps given or read from an
eval's results."""

import cProfile
import json

import pytest

from scripts.bench import host_profile


def spin(n: int) -> int:
    return sum(i * i for i in range(n))


def profiled(tmp_path):
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(4):
        spin(20_000)
    profile.disable()
    path = tmp_path / "run.prof"
    profile.dump_stats(path)
    return path


def test_a_saved_profile_lists_the_projects_functions_per_step(tmp_path, capsys):
    """4 calls of this file's spin over 8 steps: half a call a step, its time divided by 8; read from an eval's
    results.json as from --steps."""
    path = profiled(tmp_path)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"main": {"summary": {"verify_steps": 8}}}))
    outputs = []
    for steps in (["--steps", "8"], ["--results", str(results)]):
        assert host_profile.main([str(path), *steps, "--top", "5"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "8 steps" in outputs[0]
    rows = [line for line in outputs[0].splitlines() if line.startswith("| `test_host_profile.py:")]
    spin_row = next(line for line in rows if "(spin)" in line)
    assert spin_row.endswith("| 0.5 |")  # calls per step


def test_steps_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        host_profile.main([str(profiled(tmp_path)), "--steps", "0"])

"""scripts/profile_step_host.py on CPU: the quick run profiles every system and batch and writes its report."""

from scripts.profile_step_host import main


def test_quick_run_profiles_each_system_and_batch(tmp_path, capsys):
    out = tmp_path / "profile.txt"
    assert main(["--quick", "--out", str(out)]) == 0
    report = out.read_text()
    for system in ("DFlash", "AR"):
        for batch in (1, 2):
            assert f"# {system}, batch {batch}\n" in report
    assert report.count("decode steps;") == 4 and "speculator.py" in report and "Ordered by: internal time" in report
    assert capsys.readouterr().out.strip()

"""scripts/profile_step_host.py on CPU: the quick run profiles every system and batch and writes its report."""

from scripts.profile_step_host import main
from specdec.engine import decoding


def test_quick_run_profiles_each_system_and_batch(tmp_path, capsys):
    out = tmp_path / "profile.txt"
    assert main(["--quick", "--out", str(out)]) == 0
    report = out.read_text()
    for system in ("DFlash", "AR"):
        for batch in (1, 2):
            assert f"# {system}, batch {batch}\n" in report
    assert report.count("decode steps;") == 4 and "speculator.py" in report and "Ordered by: internal time" in report
    assert capsys.readouterr().out.strip()


def test_the_timeline_follows_each_step_from_its_tokens_to_the_next_verify(tmp_path):
    """--timeline adds, for DFlash, the host's path from a step's tokens to the next verify's plan, piece by piece
    (their medians), and leaves the engine as it was (no timed wrapper stays)."""
    out = tmp_path / "profile.txt"
    assert main(["--quick", "--systems", "DFlash", "--batches", "1", "--timeline", "--out", str(out)]) == 0
    report = out.read_text()
    assert "host path from a step's tokens to the next verify's launch:" in report
    for piece in ("tokens read -> step done", "next step -> verify planning", "verify plan (median",
                  "tokens read -> verify planned", "waiting for the tokens", "step (wall)"):
        assert piece in report
    assert decoding.StepTransfer.read.__name__ == "read"  # the class's own method again


def test_ops_counts_what_a_chain_step_and_a_tree_step_dispatch(tmp_path):
    """--ops adds each decode step's dispatched operations (on the CPU all of its work) per policy: a tree step
    builds and accepts its tree with more of them than a chain step needs; the engine's step is its own afterwards."""
    out = tmp_path / "profile.txt"
    assert main(["--quick", "--systems", "DFlash", "--batches", "1", "--verify", "chain", "tree", "--ops",
                 "--out", str(out)]) == 0
    chain, tree = (int(part.split("operations dispatched per step")[0].split()[-1])
                   for part in out.read_text().split("# DFlash")[1:])
    assert 0 < chain < tree

"""The tally of profiler events that scripts/profile_steps.py reports (the profile itself needs a GPU)."""

from scripts.bench.gpu_profile import Tally


def test_a_tally_gives_time_and_calls_per_step_largest_first_with_the_longest_call():
    tally = Tally()
    for name, ns in (("cudaGraphLaunch", 1_600_000), ("cudaMemcpyAsync", 5_000), ("cudaGraphLaunch", 10_000)):
        tally.add(name, ns)
    assert tally.total() == 1_615_000
    launch, copy = tally.lines(2, 5, longest=True)
    assert launch.split() == ["805.0", "us", "x", "1.0", "longest", "1600.0", "us", "cudaGraphLaunch"]
    assert copy.split()[-1] == "cudaMemcpyAsync" and "longest" in copy
    assert len(tally.lines(2, 1)) == 1 and "longest" not in tally.lines(2, 1)[0]

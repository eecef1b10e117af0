"""scripts/bench/host_speed.py: the host's speed as the median time of a fixed workload."""

import itertools

from scripts.bench import host_speed


def test_the_probe_is_the_median_sample_in_microseconds(monkeypatch):
    # samples of 3, 1, 9, 2 and 5 ms, as a clock read before and after each
    ticks = itertools.accumulate([0.0, 0.003, 0.0, 0.001, 0.0, 0.009, 0.0, 0.002, 0.0, 0.005])
    monkeypatch.setattr(host_speed, "perf_counter", lambda: next(ticks))
    assert round(host_speed.probe_us(), 6) == 3000.0


def test_the_workload_runs_whole():
    assert host_speed.workload(10) == 3 * (0 + 2 + 4 + 6 + 8)

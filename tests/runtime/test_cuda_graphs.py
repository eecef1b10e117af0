"""Graph capture housekeeping that needs no GPU."""

import gc

import pytest

from specdec.runtime.cuda_graphs import collector_paused


class Tracked:
    """An object in a reference cycle: only the garbage collector can free it."""
    freed = 0

    def __init__(self):
        self.me = self

    def __del__(self):
        Tracked.freed += 1


def test_no_collection_runs_while_graphs_are_captured():
    Tracked.freed = 0
    Tracked()  # garbage from before the capture goes first
    with collector_paused():
        assert Tracked.freed == 1 and not gc.isenabled()
        for _ in range(20_000):  # enough allocations to trigger a collection, were the collector on
            Tracked()
        assert Tracked.freed == 1
    assert gc.isenabled()
    gc.collect()
    assert Tracked.freed == 20_001


def test_the_collector_comes_back_after_a_failed_capture_and_stays_off_if_it_was():
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

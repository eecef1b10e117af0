"""scripts/bench/host_waits.py: the time spent in CUDA event waits, while counting, and nothing after."""

import time

import torch

from scripts.bench.host_waits import HostWaits


def test_event_waits_are_counted_inside_the_block_only(monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: time.sleep(0.02))  # a wait of 20 ms
    fake = lambda: torch.cuda.Event.synchronize(None)  # noqa: E731 - (an event's wait, without a GPU)
    waits = HostWaits()
    with waits:
        fake()
        fake()
    assert 0.04 <= waits.seconds < 1.0
    counted = waits.seconds
    fake()
    assert waits.seconds == counted  # restored on leaving

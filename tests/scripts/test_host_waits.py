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


def waiting_helper():  # a site of the project's code that waits
    torch.cuda.Event.synchronize(None)


def test_waits_are_counted_by_the_site_that_waited_when_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: time.sleep(0.01))
    waits = HostWaits(sites=True)
    with waits:
        for _ in range(2):
            waiting_helper()  # the same site twice
        torch.cuda.Event.synchronize(None)  # called here: a site of its own
    waited, count, synced = waits.take_sites()
    helper = next(site for site in waited if site.startswith("test_host_waits.py:"))
    assert "(waiting_helper) < test_host_waits.py:" in helper  # its caller named after it
    assert count[helper] == 2 and 0.02 <= waited[helper] < 1.0
    assert len(waited) == 2 and sum(count.values()) == 3 and not synced  # no synchronizing torch call on the CPU
    assert 0.03 <= waits.seconds < 1.5
    assert waits.take_sites() == ({}, {}, {})  # taken: counting starts anew


def test_without_sites_only_the_time_is_counted(monkeypatch):
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: time.sleep(0.005))
    waits = HostWaits()
    with waits:
        waiting_helper()
    assert waits.seconds >= 0.005 and waits.take_sites() == ({}, {}, {})

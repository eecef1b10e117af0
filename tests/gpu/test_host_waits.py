"""scripts/bench/host_waits.py on the GPU: a tensor read back by the host counted at its site (CUDA's sync debug
mode), an event wait counted with its time at its site, and the debug mode back as it was afterwards."""

import warnings

import torch

from scripts.bench.host_waits import HostWaits


def read_back(x: torch.Tensor) -> float:  # a site that waits for the GPU by itself
    return x.sum().item()


def test_synchronizing_calls_and_event_waits_are_counted_at_their_sites():
    x = torch.randn(2048, 2048, device="cuda")
    waits = HostWaits(sites=True)
    with waits:
        for _ in range(3):
            read_back(x @ x)
        done = torch.cuda.Event()
        for _ in range(8):
            x = x @ x / 2048
        done.record()
        done.synchronize()  # waits for the queued products
    waited, count, synced = waits.take_sites()
    site = next(s for s in synced if "(read_back) < test_host_waits.py:" in s)
    assert synced[site] >= 3
    event_site = next(s for s in waited if "(test_synchronizing_calls_and_event_waits" in s)
    assert count[event_site] == 1 and waited[event_site] > 0 and waits.seconds >= waited[event_site]
    assert torch.cuda.get_sync_debug_mode() == 0
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        read_back(x)  # no longer warned about
    assert not [w for w in shown if "synchroniz" in str(w.message)]

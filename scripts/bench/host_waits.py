"""How long the host waits for the GPU: the time spent in CUDA event waits (a step's read of its tokens, the guards of
pinned buffers), while counting. A step whose host never waits was host-bound: the GPU ran out of queued work before
the host queued more. On shared machines whole stretches of steps turn host-bound (every host function slower, the
same calls made), which this tells apart from a step that does more GPU work.

    waits = HostWaits()
    with waits:
        ...                      # waits.seconds grows by every event wait in here
"""

from __future__ import annotations

import time

import torch


class HostWaits:
    def __init__(self):
        self.seconds = 0.0
        self._synchronize = None

    def __enter__(self) -> "HostWaits":
        synchronize = self._synchronize = torch.cuda.Event.synchronize

        def counted(event) -> None:
            start = time.perf_counter()
            synchronize(event)
            self.seconds += time.perf_counter() - start

        torch.cuda.Event.synchronize = counted
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.Event.synchronize = self._synchronize

"""How fast the host runs Python now: the time a fixed pure-Python workload takes. On the shared GPU machines the host
ran 1.5-2x slower for seconds at a time, or for whole processes (every CUDA call and every host function slower, the
same calls made: BENCHMARKS.md, 2026-11-27 and 2026-12-06). A run measured then is slower in every host-bound step
whatever its code, so probes taken beside each run are there to say which runs compare:

    before = probe_us()
    ...                      # the run
    after = probe_us()       # set against other runs' probes on the same machine
"""

from __future__ import annotations

import statistics
from time import perf_counter

WORK = 20_000  # dict inserts and lookups per sample: ~1-2 ms on the GPU machines' hosts, cheap beside a run


def workload(n: int = WORK) -> int:
    """What the host does in a step, in miniature: dict stores and loads, integer arithmetic, a generator."""
    table = {}
    for i in range(n):
        table[i] = 3 * i
    return sum(table[i] for i in range(0, n, 2))


def probe_us(samples: int = 5) -> float:
    """The median over `samples` of the microseconds `workload` takes (the median: one sample may meet a context
    switch)."""
    times = []
    for _ in range(samples):
        start = perf_counter()
        workload()
        times.append(perf_counter() - start)
    return 1e6 * statistics.median(times)

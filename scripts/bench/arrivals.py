"""Request arrival times of `scripts/bench_serve.py --request-rate R`: a Poisson process, seeded.

Gaps between arrivals are exponential with mean 1/R, so R requests arrive per second on average and
bursts happen as they do with independent users. The first request arrives at 0 (the run starts with
traffic, not with an idle gap). The same seed gives the same schedule, so every server sees the same load.
"""

from __future__ import annotations

import numpy as np


def poisson_arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `count` requests is sent."""
    if count < 1:
        return []
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]

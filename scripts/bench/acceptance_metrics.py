"""The server's acceptance length over one load level, from its Prometheus `/metrics`.

The specdec server exports `specdec_acceptance_length` (tokens committed per verify step, bonus
included) as a histogram; reading its _sum and _count before and after a level and dividing the
differences gives the level's mean, without the warm-up or earlier levels. A server without /metrics
or without that histogram (a peer, or plain decoding that never verifies) gives None.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

ACCEPTANCE_LENGTH = "specdec_acceptance_length"


def histogram_totals(metrics_text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of the histogram `name` (all label sets added), or None when it is absent."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name or family.type != "histogram":
            continue
        total = {f"{name}_sum": 0.0, f"{name}_count": 0.0}
        for sample in family.samples:
            if sample.name in total:
                total[sample.name] += sample.value
        return total[f"{name}_sum"], total[f"{name}_count"]
    return None


async def read_acceptance_totals(http: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """The acceptance histogram's (sum, count) now; None when the server does not expose it."""
    try:
        response = await http.get(f"{base_url}/metrics", timeout=10)
        if response.status_code != 200:
            return None
        return histogram_totals(response.text, ACCEPTANCE_LENGTH)
    except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text: no acceptance numbers
        return None


def acceptance_between(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Mean acceptance length of the verify steps between two readings (None when there were none)."""
    if before is None or after is None:
        return None
    steps = after[1] - before[1]
    return (after[0] - before[0]) / steps if steps > 0 else None

"""The server's own measures over one load level, from its Prometheus `/metrics`.

The specdec server exports histograms of the acceptance length (`specdec_acceptance_length`: tokens
committed per verify step, bonus included), of the time from a request's arrival in the engine to its
first token (`specdec_time_to_first_token_seconds`) and of the time from a streamed request's arrival at
its HTTP handler to its first text sent (`specdec_server_time_to_first_token_seconds`). Reading their _sum
and _count before and after a level and dividing the differences gives the level's means, without the
warm-up or earlier levels. The three times to first token side by side (the client's, the server's, the
engine's) tell where it goes: the engine; the API process (tokenizing, the hops between processes, making
text); HTTP and the client. A server without /metrics or without a histogram (a peer; plain decoding never
verifies) gives None for it.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

ACCEPTANCE_LENGTH = "specdec_acceptance_length"
TIME_TO_FIRST_TOKEN = "specdec_time_to_first_token_seconds"
SERVER_TIME_TO_FIRST_TOKEN = "specdec_server_time_to_first_token_seconds"
HISTOGRAMS = (ACCEPTANCE_LENGTH, TIME_TO_FIRST_TOKEN, SERVER_TIME_TO_FIRST_TOKEN)

Totals = dict[str, tuple[float, float]]  # histogram name -> (sum, count)


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


async def read_totals(http: httpx.AsyncClient, base_url: str) -> Totals | None:
    """The (sum, count) of each of HISTOGRAMS the server exposes now; None without /metrics."""
    try:
        response = await http.get(f"{base_url}/metrics", timeout=10)
        if response.status_code != 200:
            return None
        found = {name: histogram_totals(response.text, name) for name in HISTOGRAMS}
    except (httpx.HTTPError, ValueError):  # unreachable, or not Prometheus text: no numbers
        return None
    return {name: totals for name, totals in found.items() if totals is not None}


def mean_between(before: Totals | None, after: Totals | None, name: str) -> float | None:
    """Mean of the observations of histogram `name` between two readings (None when there were none)."""
    if before is None or after is None or name not in before or name not in after:
        return None
    (sum_before, count_before), (sum_after, count_after) = before[name], after[name]
    count = count_after - count_before
    return (sum_after - sum_before) / count if count > 0 else None

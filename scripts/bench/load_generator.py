"""One load level of `scripts/bench_serve.py`: N requests at a fixed concurrency or at Poisson arrivals.

    concurrency C        all N requests are queued at once; at most C are in flight, a finished one's
                         slot goes to the next at once (a closed loop of C users)
    request rate R       request i is sent at its seeded Poisson arrival time (`arrivals`); an optional
                         cap C holds arrivals back while C are in flight (an open loop)

A level is bounded by its request count and by `time_left_s`: requests still running then are
cancelled and counted as unfinished, and the level's duration ends there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from scripts.bench.arrivals import poisson_arrival_times
from scripts.bench.chat_prompts import ChatPrompt
from scripts.bench.chat_request import RequestRecord


@dataclass(frozen=True)
class LoadLevel:
    num_prompts: int
    concurrency: int | None = None  # requests in flight at most (None: no cap, with a request rate)
    request_rate: float | None = None  # Poisson arrivals per second (None: all queued at once)

    @property
    def label(self) -> str:
        if self.request_rate is None:
            return f"C={self.concurrency}"
        cap = f" C<={self.concurrency}" if self.concurrency else ""
        return f"{self.request_rate:g} req/s{cap}"

    def as_dict(self) -> dict:
        return {"label": self.label, "num_prompts": self.num_prompts, "concurrency": self.concurrency,
                "request_rate": self.request_rate}


@dataclass
class LevelRun:
    records: list[RequestRecord]  # the requests that ended (successfully or not), in prompt order
    unfinished: int  # cancelled when the time ran out
    duration_s: float


Send = Callable[[int, ChatPrompt], Awaitable[RequestRecord | list[RequestRecord]]]  # a list: a conversation's turns


async def run_level(send: Send, prompts: list[ChatPrompt], level: LoadLevel, seed: int,
                    time_left_s: float) -> LevelRun:
    """send(index, prompt) for every prompt under `level`'s load, within `time_left_s`."""
    if level.request_rate is None:
        arrivals = [0.0] * len(prompts)
    else:
        arrivals = poisson_arrival_times(len(prompts), level.request_rate, seed)
    in_flight = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    start = time.perf_counter()

    async def arrive(index: int, prompt: ChatPrompt, at_s: float) -> RequestRecord:
        delay = start + at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if in_flight is None:
            return await send(index, prompt)
        async with in_flight:
            return await send(index, prompt)

    tasks = [asyncio.ensure_future(arrive(i, p, at)) for i, (p, at) in enumerate(zip(prompts, arrivals))]
    if not tasks:
        return LevelRun([], 0, 0.0)
    done, pending = await asyncio.wait(tasks, timeout=max(time_left_s, 0.0))
    duration = time.perf_counter() - start
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() for t in tasks if t in done]
    records = [r for result in results for r in (result if isinstance(result, list) else [result])]
    return LevelRun(records, len(pending), duration)

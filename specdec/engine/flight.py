"""A plain-decoding step in flight: queued on the device, its tokens not yet read back (overlapped steps).

    flight = Flight.launch(decoding, running, prefill, starting, previous)  # queue step N + 1 ...
    previous.land(commit)                                                   # ... then commit step N's tokens

The host plans and queues step N + 1 (scheduling, page tables, attention plans, input staging) before
it waits for step N's tokens, so the GPU goes from one step to the next without waiting for the host.
Step N + 1 takes the tokens step N sampled straight from the device (`carried`). What that costs: a
request that step N ends (EOS, a stop string) still runs in step N + 1, whose token for it is dropped;
its length limit is known ahead, so that one never runs past it (`Request.can_take_more`). Pages of a
finished request may go back while step N + 1 is queued: every step runs on one stream, so a later
step that reuses them writes after step N + 1 has. Speculative steps cannot overlap this way: the
next step's attention plans need this step's acceptance (its KV lengths) on the host. A DFlash engine's plain
steps (verify auto's PLAIN) can, and do: `decoding` is then the speculative phase, whose `launch` runs one; so do
its steps of prompt chunks alone, which the next step lands before it speculates. The tokens' copy to the host is
queued before the drafter's context work (`after_forward`), so landing them waits for the forward alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from attention.transfer import upload
from specdec.engine.decoding import Launched, PlainDecoding
from specdec.engine.logprobs import TokenLogprob
from specdec.engine.request import Request
from specdec.runtime.target_runner import Carried, PrefillChunks


@dataclass
class Flight:
    launched: Launched
    running: list[Request]  # one token each: rows 0 .. len(running) - 1 of the step's tokens
    starting: list[Request]  # requests whose prompt the step completed: their first tokens, after those
    prefilled: bool  # whether its forward carried prompt chunks (landing it waits for their prefill)

    @classmethod
    def launch(cls, decoding: PlainDecoding, running: list[Request], prefill: PrefillChunks | None,
               starting: list[Request], previous: Flight | None, device: torch.device) -> Flight:
        carried = previous.carried(running, device) if previous is not None else None
        launched = decoding.launch(running, prefill, carried, starting)
        for row, request in enumerate([*running, *starting]):
            request.in_flight += 1
            request.flight_row = row
        return cls(launched, running, starting, prefill is not None)

    @property
    def requests(self) -> list[Request]:
        return [*self.running, *self.starting]

    def carried(self, running: list[Request], device: torch.device) -> Carried | None:
        """Where the next step's requests find the first tokens this step sampled (still on the device)."""
        rows = [i for i, request in enumerate(running) if request.in_flight]
        if not rows:
            return None
        index = upload(np.array(rows + [running[i].flight_row for i in rows], dtype=np.int64), device)
        targets, sources = index.split(len(rows))
        return Carried(targets, self.launched.on_device[sources])

    def land(self, commit: Callable[[Request, int, TokenLogprob | None], None]) -> None:
        """Wait for the step's tokens and commit each to its request with its logprob, when asked (first
        tokens of arrivals first, as a step that runs to the end commits them); a request finished meanwhile
        takes none."""
        tokens = self.launched.tokens()
        n = len(self.running)
        running, first = ([[t] for t in part] for part in (tokens[:n], tokens[n:]))
        logprobs = [rows.read(part) if rows is not None else [None] * len(part)
                    for rows, part in zip(self.launched.logprobs, (running, first))]
        for request, token, logprob in [*zip(self.starting, tokens[n:], logprobs[1]),
                                        *zip(self.running, tokens[:n], logprobs[0])]:
            request.in_flight -= 1
            if not request.finished:
                commit(request, token, logprob[0] if logprob is not None else None)

    def drop(self) -> list[Request]:
        """Forget the step (its requests are being aborted); returns them."""
        for request in self.requests:
            request.in_flight = 0
        return self.requests

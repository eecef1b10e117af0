"""The decode phase of a step: the running requests in, the tokens each of them commits out.

    decoding = PlainDecoding(runner)                  # one token per request per step
    decoding = SpeculativeDecoding(runner, drafter)   # a drafted block verified per request (speculator.py)
    tokens = decoding.step(running)                   # list[list[int]], in the order of `running`
    launched = plain.launch(running, prefill, carried)  # plain decoding, overlapped: tokens read back later

A phase never sees the engine. The engine commits each request's tokens in order and may take fewer
(EOS, a stop string or max_new_tokens end the request; so does a failure of that request alone):
a request cut short is finished, and everything it holds goes back when the engine retires it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from attention.transfer import HostCopy
from specdec.engine.logprobs import LogprobRows, TokenLogprob
from specdec.engine.request import Request
from specdec.engine.sampler import sample_block
from specdec.runtime.target_runner import Carried, PrefillChunks, TargetRunner


class DecodePhase(Protocol):
    tokens_per_step: int  # the most tokens one request can commit in a step
    logprobs: list[list[TokenLogprob] | None] | None  # the last step's, per request (None: nobody asked)

    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        """One forward of the target for every running request (and `prefill`'s prompt chunks, whose
        output the step leaves in `prefill.out`); the tokens each running request commits."""


class PlainDecoding:
    tokens_per_step = 1

    def __init__(self, runner: TargetRunner):
        self.runner = runner
        self.logprobs = None

    @torch.no_grad()
    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        out = self.runner.run_block([r.target_pages for r in running], [r.pending_token for r in running], None, 1,
                                     prefill)
        tokens = sample_block(out, running, 1)
        rows = LogprobRows.start(out.logits, tokens, running, 1)
        host = to_host(tokens[:, None], prefill)
        self.logprobs = rows.read(host) if rows is not None else None
        return host

    @torch.no_grad()
    def launch(self, running: list[Request], prefill: PrefillChunks | None, carried: Carried | None,
               starting: list[Request] = (), after_forward=None) -> "Launched":
        """The same step without waiting for its tokens (overlapped steps): they stay on the device, where
        the next step can read them (`carried`: this step's first tokens that are still there), and are
        on their way to the host, where `Launched.tokens` reads them. `starting`: the requests whose first
        tokens the prefill samples (their logprobs, when asked). `after_forward(running, prefill)` queues more
        work on the forward's outputs (a drafter's context)."""
        parts, logprobs = [], [None, None]
        if running:
            out = self.runner.run_block([r.target_pages for r in running],
                                        [0 if r.in_flight else r.pending_token for r in running], None, 1, prefill,
                                        carried)
            parts.append(sample_block(out, running, 1).view(-1).long())
            logprobs[0] = LogprobRows.start(out.logits, parts[-1], running, 1)
        else:
            self.runner.run_prefill(prefill)
        if prefill is not None and prefill.sample_first is not None:
            parts.append(prefill.sample_first(prefill.out.logits).view(-1).long())
            logprobs[1] = LogprobRows.start(prefill.out.logits, parts[-1], starting, 1)
        launched = Launched(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.runner.device),
                            tuple(logprobs))
        if after_forward is not None:  # queued after the tokens' copy: reading them waits for the forward alone
            after_forward(running, prefill)
        return launched


class Launched:
    """A step's sampled tokens on the device (a tensor of their own: the next step overwrites the static
    buffers) and their copy on its way to the host, started as soon as the step's work is queued."""

    def __init__(self, on_device: torch.Tensor, logprobs: tuple[LogprobRows | None, LogprobRows | None] = (None, None)):
        self.on_device = on_device
        self.logprobs = logprobs  # of the running requests' rows, and of the first tokens' (None: nobody asked)
        self._copy = HostCopy(on_device)

    def tokens(self) -> list[int]:
        """The step's one wait for the GPU: its tokens on the host."""
        return self._copy.tolist()


class StepTransfer:
    """The step's one device-to-host transfer, queued when made: `rows` [B, k] and, when the step's chunks
    complete prompts, their first tokens. `read` waits for this copy alone, so work queued after it (the next
    step's draft) keeps the GPU busy while the host reads."""

    def __init__(self, rows: torch.Tensor, prefill: PrefillChunks | None, first_tokens: torch.Tensor | None = None):
        """first_tokens: the prefill's first tokens if the caller sampled them already (sampled here otherwise)."""
        self.shape, self.prefill = tuple(rows.shape), prefill
        if first_tokens is None and prefill is not None and prefill.sample_first is not None:
            first_tokens = prefill.sample_first(prefill.out.logits)
        self.with_first_tokens = first_tokens is not None
        # without first tokens the rows are copied as they are: their lists come from one tolist, without a Python
        # slice per row
        self._copy = HostCopy(torch.cat([rows.reshape(-1), first_tokens]) if self.with_first_tokens else rows)

    def read(self) -> list[list[int]]:
        """`rows` as lists (and the first tokens into `prefill.first_tokens`)."""
        host = self._copy.tolist()
        if not self.with_first_tokens:
            return host
        batch, k = self.shape
        self.prefill.first_tokens = host[batch * k:]
        return [host[i:i + k] for i in range(0, batch * k, k)]


def to_host(rows: torch.Tensor, prefill: PrefillChunks | None) -> list[list[int]]:
    """The step's one device-to-host transfer, waited for at once (`StepTransfer`)."""
    return StepTransfer(rows, prefill).read()

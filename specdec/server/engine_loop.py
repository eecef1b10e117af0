"""The serving loop around an `Engine`: submissions and aborts in, per-submission outputs out.

Whoever hosts it (a thread of the server's process, or a process of its own) owns it alone and
calls it from one thread: `apply` a command between steps, `step` while `busy`, `end_all` at
shutdown. Submissions are named by the caller's ids (`sid`), so that outputs can travel between
processes as plain data: a list of `(sid, RequestOutput)` per call. Outputs carry token ids only:
text and stop strings are the callers' side's (`specdec/server/request_text.py`), so the engine's
host time goes to steps alone.

A failure of one request fails that request alone (the engine contains it); a failure of a whole
step fails the requests of that step, and the loop goes on serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from specdec.engine.engine import Engine
from specdec.engine.logprobs import TokenLogprob
from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams
from specdec.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle engine loop waits for a command before it checks again
STOP = "stop"  # the command that ends `serve`


@dataclass
class RequestOutput:
    """What one request produced since its last output."""

    text: str  # new text (pieces add up to the whole text); "" from the engine loop, which ships tokens
    token_ids: list[int]  # new tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort" once finished
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens so far
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not prefilled)
    logprobs: list[TokenLogprob] | None = None  # the new tokens', when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first output, when it asked (echo)
    stop_reason: str | int | None = None  # once finished by a stop: the stop string or stop token id (vLLM's)


@dataclass(frozen=True)
class Submit:
    sid: int
    prompt_ids: list[int]
    params: SamplingParams
    lead: int | None = None  # another answer of the same prompt, submitted first (n > 1): it shares its prefill


@dataclass(frozen=True)
class Abort:
    sid: int  # the caller stopped listening: nothing more is sent for it
    reason: str = "abort"  # or "stop": the caller matched a stop string (metrics count it as a stop)


@dataclass(frozen=True)
class ResetPrefixCache:
    """Empty the prefix cache of what no request holds, between steps; `done` gets how many pages it dropped."""
    done: Callable[[int], None]


@dataclass(eq=False)
class _Live:
    sid: int
    request: Request
    tokens_sent: int = 0


Outputs = list[tuple[int, RequestOutput]]


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics(block_size=engine.drafter.block_size if engine.drafter else 0)
        self._live: dict[int, _Live] = {}  # request id -> submission
        self._by_sid: dict[int, _Live] = {}
        # structured output's view of the tokenizer takes a second or two to build: before serving, not while the
        # first such request holds up everyone's steps (a model it cannot serve fails those requests alone)
        try:
            engine.grammars
        except ValueError as err:
            log.warning("structured output is not available for this model: %s", err)

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests

    def apply(self, command: Submit | Abort | ResetPrefixCache) -> Outputs:
        if isinstance(command, Submit):
            return self._submit(command)
        if isinstance(command, ResetPrefixCache):
            command.done(self.engine.reset_prefix_cache())
            return []
        self._abort(command.sid, command.reason)
        return []

    def _submit(self, command: Submit) -> Outputs:
        lead = self._by_sid.get(command.lead) if command.lead is not None else None
        request = self.engine.add_request(command.prompt_ids, command.params, lead.request if lead else None)
        live = _Live(command.sid, request)
        if request.finished:  # refused up front (e.g. the pool can never hold it)
            return [self._finish(live)]
        self._live[request.request_id] = live
        self._by_sid[command.sid] = live
        return []

    def _abort(self, sid: int, reason: str) -> None:
        live = self._by_sid.pop(sid, None)
        if live is not None and self._live.pop(live.request.request_id, None) is not None:
            self.engine.abort(live.request.request_id, reason)
            self.metrics.on_finish(live.request)

    def step(self, deliver_first: Callable[[Outputs], None] | None = None) -> Outputs:
        """One engine step; returns its outputs. With `deliver_first`, a request's first tokens go to it the moment
        they are committed (time to first token), ahead of the rest of the step and its bookkeeping; what a
        failing `deliver_first` raised (the host's channel closed) is raised once the step is over."""
        start = time.perf_counter()
        undelivered: list[BaseException] = []
        try:
            out = self.engine.step(self._first_tokens(deliver_first, undelivered) if deliver_first else None)
        except Exception as err:  # noqa: BLE001 - the step's requests fail; the loop goes on
            log.exception("an engine step failed; its requests are ended with an error")
            failed = self.engine.abort_all(reason="error", message=f"the engine failed: {type(err).__name__}: {err}")
            return self._finish_all(failed)
        if undelivered:
            raise undelivered[0]
        self.metrics.on_step(self.engine, out, time.perf_counter() - start)
        outputs = []
        for request, _ in out.committed:
            live = self._live.get(request.request_id)
            new = request.output_ids[live.tokens_sent:] if live is not None and not request.finished else None
            if new:  # (none when delivered first, or when an earlier commit of the same step took them)
                outputs.append(self._output(live, RequestOutput("", new)))
        return outputs + self._finish_all(out.finished)

    def _first_tokens(self, deliver: Callable[[Outputs], None],
                      undelivered: list[BaseException]) -> Callable[[Request, list[int]], None]:
        """The engine's on_commit for `step(deliver_first)`."""
        def on_commit(request: Request, tokens: list[int]) -> None:
            live = self._live.get(request.request_id)
            if live is None or live.tokens_sent or not tokens or request.finished or undelivered:
                return  # finished: the step's end sends it with its finish reason
            try:
                deliver([self._output(live, RequestOutput("", list(tokens)))])
            except Exception as err:  # noqa: BLE001 - raised after the engine's step, not in the middle of it
                undelivered.append(err)
        return on_commit

    def end_all(self, message: str = "the server is shutting down") -> Outputs:
        """Abort every request (shutdown) and tell their callers."""
        return self._finish_all(self.engine.abort_all(reason="abort", message=message))

    def render_metrics(self) -> bytes:
        self.metrics.observe_pools(self.engine)
        return self.metrics.render()

    def _finish_all(self, requests: list[Request]) -> Outputs:
        outputs = []
        for request in requests:
            live = self._live.pop(request.request_id, None)
            if live is not None:
                self._by_sid.pop(live.sid, None)
                outputs.append(self._finish(live))
        return outputs

    def _finish(self, live: _Live) -> tuple[int, RequestOutput]:
        request = live.request
        self.metrics.on_finish(request)
        return self._output(live, RequestOutput("", request.output_ids[live.tokens_sent:], True, request.finish_reason,
                                                request.error))

    def _output(self, live: _Live, out: RequestOutput) -> tuple[int, RequestOutput]:
        if live.tokens_sent == 0:
            out.prompt_logprobs = live.request.prompt_logprobs
        asked = live.request.output_logprobs
        if asked is not None:
            out.logprobs = asked[live.tokens_sent:live.tokens_sent + len(out.token_ids)]
        live.tokens_sent += len(out.token_ids)
        out.prompt_tokens, out.completion_tokens = len(live.request.prompt_ids), live.tokens_sent
        out.cached_tokens = live.request.stats.cached_tokens or 0
        return live.sid, out


def serve(loop: EngineLoop, receive: Callable[[float], Iterable], deliver: Callable[[Outputs], None]) -> None:
    """The serving loop of every host: apply the commands that came in (`receive(wait_s)` waits up to
    wait_s for the first, IDLE_WAIT_S while idle), step while busy, deliver each round's outputs (a
    request's first tokens as soon as they are committed); at STOP, end what is left and deliver that too.
    An exception (the host's channel closed, a failing engine) propagates to the host."""
    running = True
    while running:
        outputs = []
        for command in receive(0 if loop.busy else IDLE_WAIT_S):
            if command == STOP:
                running = False
                break
            outputs += loop.apply(command)
        if running and loop.busy:
            outputs += loop.step(deliver)
        if outputs:
            deliver(outputs)
    deliver(loop.end_all())

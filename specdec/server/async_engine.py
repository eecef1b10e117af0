"""The engine for asyncio callers (the server): `generate` yields one request's outputs as they come.

    engine = ThreadedEngine(llm)        # the engine loop on a thread of this process
    engine = ProcessEngine.start(...)   # ... or in a process of its own (specdec/server/engine_process.py)
    async for out in engine.generate(prompt_ids, params):
        ...                             # out.text: new text; out.finished, out.finish_reason, usage
    await engine.shutdown()

Callers hand submissions and aborts to the engine loop (`specdec/server/engine_loop.py`), which applies
them between steps, so requests join and leave the running batch there; the outputs of a step (token
ids) come back in one batch (a request's first tokens ahead of it, as soon as they are committed) and
are handed to each caller's asyncio queue on the event loop, where each caller turns its tokens into
text and matches its stop strings (`request_text.py`). A caller that stops listening (a client that
disconnected, a cancelled task) aborts its request: its pages are back in the pool before the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from typing import AsyncIterator

from specdec.engine.request_limits import RequestLimits
from specdec.engine.sampling_params import SamplingParams
from specdec.server.engine_loop import (STOP, Abort, EngineLoop, Outputs, RequestOutput, ResetPrefixCache, Submit,
                                        serve)
from specdec.server.request_text import RequestText, engine_params

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 60.0  # a prefix cache reset waits for the step in progress (a long prefill: seconds)


class AsyncEngine:
    """The callers' side, whatever hosts the engine loop: submission ids, queues, delivery."""

    def __init__(self, limits: RequestLimits, tokenizer, eos_token_ids: frozenset[int]):
        self.limits = limits
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # the engine's: request texts end where the engine ends
        self._ids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- to be provided by the host ------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        raise NotImplementedError

    def _send(self, command: Submit | Abort) -> None:
        raise NotImplementedError

    async def metrics_text(self) -> bytes:
        raise NotImplementedError

    async def reset_prefix_cache(self) -> int:
        """Empty the prefix cache of what no request holds (between the engine's steps); how many pages it dropped."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    # ---- callers -------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving the loop early (or being cancelled) aborts it.
        Outputs that arrive while the caller is busy are merged, so a slow reader gets fewer, larger pieces."""
        [stream] = self.generate_samples(prompt_ids, params)
        return stream

    def generate_samples(self, prompt_ids: list[int], params: SamplingParams) -> list[AsyncIterator[RequestOutput]]:
        """The params.n answers of one prompt, each a `generate` stream (answer j seeded with seed + j). A stream
        submits its request when first read: read them in order (the first one first), and the others share
        its prefill."""
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        self.bind_event_loop()
        sids = [next(self._ids) for _ in range(params.n)]
        return [self._stream(sid, prompt_ids, params.for_sample(j), sids[0] if j else None) for j, sid in enumerate(sids)]

    async def _stream(self, sid: int, prompt_ids: list[int], params: SamplingParams,
                      lead: int | None) -> AsyncIterator[RequestOutput]:
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[sid] = outputs
        self._send(Submit(sid, list(prompt_ids), engine_params(params), lead))  # first: the engine starts now
        engine_done, text = False, None
        try:
            # needed once the first output is back
            text = RequestText(prompt_ids, params, self.tokenizer, self.eos_token_ids)
            while True:
                raw = merge([await outputs.get(), *drain(outputs)])
                engine_done = raw.finished
                out = text.update(raw)
                yield out
                if out.finished:
                    break
        finally:
            self._queues.pop(sid, None)
            if not engine_done:  # the caller left, or a stop string ended the request first
                self._send(Abort(sid, "stop" if text is not None and text.stopped_early else "abort"))

    def bind_event_loop(self) -> None:
        """Outputs are handed to callers on the running event loop (the server's)."""
        self._loop = asyncio.get_running_loop()

    def deliver(self, outputs: Outputs) -> None:
        """A batch of outputs from the engine loop, handed over on the event loop's thread."""
        for sid, out in outputs:
            target = self._queues.get(sid)
            if target is not None:
                target.put_nowait(out)

    def deliver_threadsafe(self, outputs: Outputs) -> None:
        """`deliver` from any thread: one wake-up of the event loop per batch."""
        loop = self._loop
        if outputs and loop is not None:
            try:
                loop.call_soon_threadsafe(self.deliver, outputs)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

    def end_all(self, message: str) -> None:
        """End every caller's request now (the server is stopping): each is aborted in the engine, and its
        caller gets a last output finished "abort" with `message` (on the event loop's thread)."""
        ended = list(self._queues)
        for sid in ended:
            self._send(Abort(sid, "abort"))
        self.deliver([(sid, RequestOutput("", [], True, "abort", message)) for sid in ended])

    def fail_all(self, message: str) -> None:
        """The engine is gone: end every caller's request with an error (on the event loop's thread)."""
        self.deliver([(sid, RequestOutput("", [], True, "error", message)) for sid in list(self._queues)])


def drain(outputs: asyncio.Queue) -> list[RequestOutput]:
    items = []
    while not outputs.empty():
        items.append(outputs.get_nowait())
    return items


def merge(items: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one (text and tokens joined; the last one's state). Nothing after
    a finished output counts: a request the server ended (`end_all`) may still get the engine's tokens of
    the steps before it saw the abort."""
    finished = next((i for i, item in enumerate(items) if item.finished), None)
    if finished is not None:
        items = items[:finished + 1]
    if len(items) == 1:
        return items[0]
    last = items[-1]
    return RequestOutput("".join(o.text for o in items), [t for o in items for t in o.token_ids], last.finished,
                         last.finish_reason, last.error, last.prompt_tokens, last.completion_tokens, last.cached_tokens,
                         None if all(o.logprobs is None for o in items) else [e for o in items for e in o.logprobs or []],
                         next((o.prompt_logprobs for o in items if o.prompt_logprobs is not None), None),
                         last.stop_reason)


class ThreadedEngine(AsyncEngine):
    """The engine loop on a thread of this process (tests, and embedding the server in a program)."""

    def __init__(self, llm):
        super().__init__(llm.engine.limits, llm.tokenizer, llm.engine.eos_token_ids)
        self.loop = EngineLoop(llm.engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self._thread = threading.Thread(target=self._serve, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def _send(self, command: Submit | Abort) -> None:
        self._commands.put(command)

    async def metrics_text(self) -> bytes:
        return self.loop.render_metrics()

    async def reset_prefix_cache(self) -> int:
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._send(ResetPrefixCache(done.set_result))  # applied by the engine thread between steps
        return await asyncio.wait_for(asyncio.wrap_future(done), RESET_TIMEOUT_S)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._stop.set()
        self._commands.put(None)  # wake an idle loop
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    def _serve(self) -> None:
        try:
            serve(self.loop, self._receive, self.deliver_threadsafe)
        except BaseException as err:  # noqa: BLE001 - recorded for /health; the callers are told below
            log.exception("the engine thread stopped")
            self.error = err
            self.deliver_threadsafe(self.loop.end_all())
        finally:
            self._stop.set()

    def _receive(self, wait_s: float) -> list:
        """The queued commands (waiting up to wait_s for the first), then STOP once shutdown was asked."""
        commands = []
        try:
            command = self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait()
            while True:
                if command is not None:  # None only wakes an idle loop
                    commands.append(command)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        return commands + [STOP] if self._stop.is_set() else commands

"""The engine on a thread of its own, for asyncio callers (the server).

    engine = AsyncEngine(llm)          # starts the engine thread
    async for out in engine.generate(prompt_ids, params):
        ...                            # out.text: new text; out.finished, out.finish_reason, out.usage
    await engine.shutdown()

Only the engine thread touches the `Engine`: callers hand it submissions and aborts through a
thread-safe queue, which it applies between steps (requests join and leave the running batch there),
and it hands each request's outputs to the caller's asyncio queue on the caller's event loop. While
no request is left it sleeps on that queue, so an idle server costs nothing.

A caller that stops listening (a client that disconnected, a cancelled task) aborts its request:
its pages are back in the pool before the next step. A failure of one request fails that request
alone; a failure of a whole step fails the requests of that step, and the engine goes on serving.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from specdec.engine import Engine, StepOutput
from specdec.request import Request
from specdec.sampling_params import SamplingParams
from specdec.text_stream import TextStream, final_text

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle engine thread sleeps between checks for shutdown


@dataclass
class RequestOutput:
    """What one request produced since its last output."""

    text: str  # new text (pieces add up to the whole text)
    token_ids: list[int]  # new tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort" once finished
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class _Submission:
    """A caller's request on its way to (and inside) the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    outputs: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    request: Request | None = None  # set by the engine thread
    stream: TextStream | None = None
    ended: bool = False  # the last output was sent (or the caller is gone)
    tokens_sent: int = 0


class EngineObserver:
    """Hooks the engine thread calls (metrics); every method is optional."""

    def on_step(self, engine: Engine, out: StepOutput, seconds: float) -> None:
        pass

    def on_finish(self, request: Request) -> None:
        pass


class AsyncEngine:
    def __init__(self, llm, observer: EngineObserver | None = None):
        self.llm = llm
        self.engine: Engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.observer = observer or EngineObserver()
        self._commands: queue.SimpleQueue[tuple[str, _Submission | None]] = queue.SimpleQueue()
        self._live: dict[int, _Submission] = {}  # engine thread only: request id -> submission
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did
        self._thread = threading.Thread(target=self._serve, name="specdec-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # ---- the callers' side (event loop) --------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving the loop early (or being cancelled) aborts it."""
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        submission = _Submission(list(prompt_ids), params, asyncio.Queue(), asyncio.get_running_loop())
        self._commands.put(("add", submission))
        finished = False
        try:
            while not finished:
                out: RequestOutput = await submission.outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._commands.put(("abort", submission))

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._stop.set()
        self._commands.put(("wake", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s)

    # ---- the engine thread -----------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(wait=not self.engine.has_unfinished_requests)
                if self.engine.has_unfinished_requests and not self._stop.is_set():
                    self._step()
        except BaseException as err:  # noqa: BLE001 - recorded for /health; the callers are told below
            log.exception("the engine thread stopped")
            self.error = err
        finally:
            self._stop.set()
            self._end_all("abort", "the server is shutting down")

    def _apply_commands(self, wait: bool) -> None:
        try:
            command, submission = self._commands.get(timeout=IDLE_WAIT_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command == "add":
                self._add(submission)
            elif command == "abort":
                self._abort(submission)
            try:
                command, submission = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, submission: _Submission) -> None:
        if submission.ended:
            return
        request = self.engine.add_request(submission.prompt_ids, submission.params)
        submission.request = request
        request.use_detokenizer(self.tokenizer)  # streaming text
        submission.stream = TextStream(request)
        if request.finished:  # refused up front (e.g. the pool can never hold it)
            self._finish(submission)
            return
        self._live[request.request_id] = submission

    def _abort(self, submission: _Submission) -> None:
        submission.ended = True  # the caller is gone: nothing more is sent
        request = submission.request
        if request is not None and self._live.pop(request.request_id, None) is not None:
            self.engine.abort(request.request_id)
            self.observer.on_finish(request)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            out = self.engine.step()
        except Exception as err:  # noqa: BLE001 - the step's requests fail; the engine goes on
            log.exception("an engine step failed; its requests are ended with an error")
            failed = self.engine.abort_all(reason="error", message=f"the engine failed: {type(err).__name__}: {err}")
            for request in failed:
                submission = self._live.pop(request.request_id, None)
                if submission is not None:
                    self._finish(submission)
            return
        self.observer.on_step(self.engine, out, time.perf_counter() - start)
        for request, tokens in out.committed:
            submission = self._live.get(request.request_id)
            if submission is not None and not request.finished:
                self._send(submission, RequestOutput(submission.stream.take(), tokens))
        for request in out.finished:
            submission = self._live.pop(request.request_id, None)
            if submission is not None:
                self._finish(submission)

    def _finish(self, submission: _Submission) -> None:
        request = submission.request
        text = submission.stream.take(final_text(self.tokenizer, request))
        new_tokens = request.output_ids[submission.tokens_sent:]
        self._send(submission, RequestOutput(text, new_tokens, True, request.finish_reason, request.error))
        submission.ended = True
        self.observer.on_finish(request)

    def _send(self, submission: _Submission, out: RequestOutput) -> None:
        if submission.ended:
            return
        submission.tokens_sent += len(out.token_ids)
        out.prompt_tokens, out.completion_tokens = len(submission.prompt_ids), submission.tokens_sent
        try:
            submission.loop.call_soon_threadsafe(submission.outputs.put_nowait, out)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            submission.ended = True

    def _end_all(self, reason: str, message: str) -> None:
        """Finish every request still in the engine (shutdown) and tell their callers."""
        try:
            ended = self.engine.abort_all(reason=reason, message=message)
        except Exception:  # noqa: BLE001 - shutting down: tell the callers regardless
            log.exception("aborting the remaining requests failed")
            ended = []
        for request in ended:
            submission = self._live.pop(request.request_id, None)
            if submission is not None:
                self._finish(submission)
        while True:  # submissions that never reached the engine
            try:
                command, submission = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add" and not submission.ended:
                self._send(submission, RequestOutput("", [], True, reason, message))
                submission.ended = True

"""The engine loop in a process of its own, so that HTTP work never takes the engine's interpreter.

The engine is host-bound (Python around every GPU step); in one process, handlers serializing
thousands of stream chunks a second would share its interpreter lock and slow every step. Here
the engine process loads the model and runs `EngineLoop` alone, shipping token ids; the server's
process keeps the tokenizer (for prompts, and for the outputs' text and stop strings) and the request
limits (to refuse bad input before it travels).

    parent -> child   Submit / Abort commands, ("metrics",), ("reset_prefix_cache",), ("stop",)
    child -> parent   ("ready", limits, eos_token_ids, model_dir) once; ("outputs", [(sid, RequestOutput)]) per
                      step (and for a request's first tokens as they are committed); ("metrics", text);
                      ("reset_prefix_cache", pages dropped); ("failed", message) if the model cannot be loaded

over one `multiprocessing` pipe. The child ignores SIGINT and SIGTERM (a Ctrl-C in the terminal, or a
SIGTERM to the whole process group, reaches it too; the server decides when the engine stops, after its
in-flight answers have ended) and exits when told to stop or when the pipe closes.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import threading
from pathlib import Path
from typing import Callable

from specdec.server.async_engine import RESET_TIMEOUT_S, AsyncEngine
from specdec.server.engine_loop import STOP, Abort, EngineLoop, ResetPrefixCache, Submit, serve
from specdec.server.startup_heap import freeze_startup_heap

log = logging.getLogger(__name__)

START_TIMEOUT_S = 3600.0  # a first run converts a demo model's GGUF before it loads


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why)."""


class ProcessEngine(AsyncEngine):
    def __init__(self, process, conn, limits, tokenizer, eos_token_ids):
        super().__init__(limits, tokenizer, eos_token_ids)
        self._process, self._conn = process, conn
        self._send_lock = threading.Lock()
        self._metrics: asyncio.Future | None = None
        self._resets: list[asyncio.Future] = []  # resets asked, answered in order
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="specdec-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, build: Callable, log_level: str = "WARNING", timeout_s: float = START_TIMEOUT_S) -> "ProcessEngine":
        """Start the engine process, which calls `build()` (picklable; it returns an object with the loaded
        `engine`, its `tokenizer` and `model_dir`, such as an `LLM`), and wait until the model is loaded."""
        from specdec.models.loader import load_tokenizer

        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        parent_conn, child_conn = context.Pipe()
        process = context.Process(target=run_engine_process, args=(child_conn, build, log_level),
                                  name="specdec-engine", daemon=True)
        process.start()
        child_conn.close()
        if not parent_conn.poll(timeout_s):
            process.kill()
            raise EngineStartError(f"the engine process did not load the model within {timeout_s:.0f} s")
        try:
            message = parent_conn.recv()
        except EOFError:
            process.join(5)
            raise EngineStartError(f"the engine process exited with status {process.exitcode} while loading the "
                                   f"model") from None
        if message[0] == "failed":
            process.join(5)
            raise EngineStartError(message[1])
        _, limits, eos_token_ids, model_dir = message
        return cls(process, parent_conn, limits, load_tokenizer(Path(model_dir)), eos_token_ids)

    @property
    def healthy(self) -> bool:
        return self._process.is_alive() and self._reader.is_alive() and not self._stopping

    def _send(self, command) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the engine process is gone: its reader fails the callers
                pass

    async def metrics_text(self) -> bytes:
        if not self.healthy:
            return b""
        self.bind_event_loop()
        if self._metrics is None or self._metrics.done():  # scrapes at once share one ask of the engine
            self._metrics = asyncio.get_running_loop().create_future()
            self._send(("metrics",))
        try:
            return await asyncio.wait_for(asyncio.shield(self._metrics), 10)
        except asyncio.TimeoutError:
            return b""

    async def reset_prefix_cache(self) -> int:
        if not self.healthy:
            raise RuntimeError("the engine is not running")
        self.bind_event_loop()
        answer = asyncio.get_running_loop().create_future()
        self._resets.append(answer)
        self._send(("reset_prefix_cache",))
        return await asyncio.wait_for(answer, RESET_TIMEOUT_S)

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left, stop the engine process and wait for it."""
        self._stopping = True
        self._send(("stop",))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._process.join, timeout_s)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
        await loop.run_in_executor(None, self._reader.join, 5)

    def _read(self) -> None:
        """Outputs from the engine process, handed to the event loop; callers fail if the process dies."""
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "outputs":
                    self.deliver_threadsafe(message[1])
                elif message[0] == "metrics" and self._metrics is not None and self._loop is not None:
                    self._loop.call_soon_threadsafe(_resolve, self._metrics, message[1])
                elif message[0] == "reset_prefix_cache" and self._resets and self._loop is not None:
                    self._loop.call_soon_threadsafe(_resolve, self._resets.pop(0), message[1])
        except (EOFError, OSError):
            pass
        if not self._stopping:
            log.error("the engine process stopped (exit status %s)", self._process.exitcode)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.fail_all, "the engine process stopped")
            except RuntimeError:
                pass


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def run_engine_process(conn, build: Callable, log_level: str) -> None:
    """The engine process: load the model, then serve commands until told to stop or the pipe closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine): %(message)s")
    try:
        loaded = build()
    except Exception as err:  # noqa: BLE001 - reported to the server, which exits with the message
        conn.send(("failed", " ".join(str(err).split()) or type(err).__name__))
        return
    loop = EngineLoop(loaded.engine)
    if hasattr(loaded, "describe"):
        log.info("serving %s", loaded.describe())
    log.info("%d objects of the loaded engine kept out of the garbage collector", freeze_startup_heap())
    conn.send(("ready", loaded.engine.limits, loaded.engine.eos_token_ids, str(loaded.model_dir)))

    def receive(wait_s: float) -> list:
        """Submissions, aborts and resets that came in (waiting up to wait_s for the first); answers metrics here."""
        commands = []
        if conn.poll(wait_s):
            while conn.poll():
                command = conn.recv()
                if isinstance(command, (Submit, Abort)):
                    commands.append(command)
                elif command[0] == "metrics":
                    conn.send(("metrics", loop.render_metrics()))
                elif command[0] == "reset_prefix_cache":  # applied by the loop in order with the others
                    commands.append(ResetPrefixCache(lambda pages: conn.send(("reset_prefix_cache", pages))))
                elif command[0] == STOP:
                    return commands + [STOP]
        return commands

    try:
        serve(loop, receive, lambda outputs: conn.send(("outputs", outputs)))
    except (EOFError, OSError):  # the server is gone
        return

"""A server launched by `scripts/bench_serve.py --serve`: started, waited for, stopped, all bounded.

The command gets a free port on 127.0.0.1 (the server never listens elsewhere) and runs in a process
group of its own, so that a Ctrl-C in the terminal reaches the benchmark, which then stops the server
itself. Its output goes to a log file; if it exits before /health answers, the error carries the
log's tail. Stopping sends SIGINT (the server finishes or aborts what is in flight and exits), then
SIGTERM, then SIGKILL, each after a bounded wait.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """`command_for(port)` run from the repository root with its output in `log_path`."""

    def __init__(self, command_for: Callable[[int], list[str]], log_path: Path, stop_timeout_s: float = 60.0):
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.command = command_for(self.port)
        self.log_path, self.stop_timeout_s = Path(log_path), stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_until_healthy(self, timeout_s: float, poll_s: float = 0.25) -> float:
        """Seconds until GET /health answered 200; raises ServerStartError when the server exits first
        or is not healthy within timeout_s."""
        started = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"the server exited with status {code} before it was healthy; "
                                       f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5, trust_env=False).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass  # not listening yet
            if time.monotonic() - started > timeout_s:
                raise ServerStartError(f"the server was not healthy within {timeout_s:.0f} s; last lines of "
                                       f"{self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(poll_s)

    def stop(self) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL until the process is gone; returns its exit status."""
        if self.proc is None:
            return None
        for send, wait_s in ((lambda: self.proc.send_signal(signal.SIGINT), self.stop_timeout_s),
                             (lambda: self.proc.send_signal(signal.SIGTERM), 10.0),
                             # its process group: helpers it started (kernel compilers) go too
                             (lambda: os.killpg(self.proc.pid, signal.SIGKILL), 10.0)):
            if self.proc.poll() is not None:
                break
            try:
                send()
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        return self.proc.poll()

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

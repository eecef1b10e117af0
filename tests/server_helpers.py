"""A real server for tests: uvicorn on 127.0.0.1 (a free port), in a thread or in a process of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(base_url: str, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server stopped before it was healthy")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url} was not healthy within {timeout_s} s")


class ThreadServer:
    """`app` served by uvicorn on a thread of this process (the test can look inside the engine)."""

    def __init__(self, app, timeout_graceful_shutdown: float = 5.0, **config):
        """config: more uvicorn.Config settings (e.g. http, the protocol class)."""
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=timeout_graceful_shutdown, **config)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        wait_until_healthy(self.base_url, 60, self.thread.is_alive)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the server did not stop"


class ProcessServer:
    """`python -m specdec.serve ARGS` in a process of its own, for signals and the command line."""

    def __init__(self, *args: str, new_session: bool = False):
        """new_session: the server leads a process group of its own (signals to the group reach only it and
        its engine process)."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "specdec.serve", *args, "--host", "127.0.0.1", "--port", str(self.port),
                   "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=new_session)

    def __enter__(self) -> "ProcessServer":
        try:
            wait_until_healthy(self.base_url, 120, lambda: self.proc.poll() is None)
        except BaseException:
            self.kill()
            raise RuntimeError(f"the server did not start:\n{self.output()}")
        return self

    def signal(self, sig: signal.Signals, group: bool = False) -> None:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)

    def output(self) -> str:
        return self.proc.stdout.read() if self.proc.poll() is not None else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __exit__(self, *exc) -> None:
        self.kill()

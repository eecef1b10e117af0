"""The server's processes keep their startup heap out of the garbage collector (specdec/server/startup_heap.py):
the engine process before it reports ready, and the helper itself moves what is alive into the permanent
generation."""

import functools
import gc
import multiprocessing
import signal

from specdec import LLM
from specdec.server import engine_process
from specdec.server.startup_heap import freeze_startup_heap
from tests.conftest import build_tiny_model_with_tokenizer


def test_freezing_moves_every_live_object_out_of_the_collector():
    kept = []  # alive when frozen
    try:
        frozen = freeze_startup_heap()
        # frozen objects may still be freed (a thread an earlier test left behind dropping its last references), so
        # the permanent generation can shrink after the call, never grow: nothing else freezes
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(obj is kept for obj in gc.get_objects())  # no longer among the tracked ones
    finally:
        gc.unfreeze()  # the test process goes on freeing its objects


def test_the_engine_process_freezes_its_heap_once_loaded_and_before_it_reports_ready(tmp_path, monkeypatch):
    target = build_tiny_model_with_tokenizer(tmp_path / "target")
    events = []
    monkeypatch.setattr(engine_process, "freeze_startup_heap", lambda: events.append("freeze") or 1)
    parent, child = multiprocessing.Pipe()
    send = child.send

    class Recorded:  # the child's end, noting what it sends
        def __getattr__(self, name):
            return getattr(child, name)

        def send(self, message):
            events.append(message[0])
            send(message)

    parent.send(("stop",))  # served at once: the engine starts, reports ready, and stops
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine_process.run_engine_process(Recorded(), functools.partial(LLM, str(target), None, device="cpu",
                                                                         num_kv_pages=64), "WARNING")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert events[:2] == ["freeze", "ready"]
    assert parent.recv()[0] == "ready"

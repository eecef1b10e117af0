"""What one client must not be able to do to the server: stall everyone with a giant or half-sent body,
get a plain-text 500 for text that cannot be encoded, leave tracebacks by disconnecting, starve
concurrent /metrics scrapes, or have values accepted that the library refuses (one table of cases for
both)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from specdec import LLM, SamplingParams
from specdec.server.async_engine import ThreadedEngine
from specdec.server.header_timeout import header_timeout_protocol
from specdec.server.openai_api import build_app
from tests.conftest import build_tiny_model_with_tokenizer
from tests.server_helpers import ProcessServer, ThreadServer
from tests.tokenizer_helpers import CHAT_TEMPLATE

MODEL = "tiny"
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("hardening") / "target",
                                               chat_template=CHAT_TEMPLATE))


@pytest.fixture(scope="module")
def server(target):
    llm = LLM(target, device="cpu", num_kv_pages=256, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL, max_body_bytes=MAX_BODY, body_timeout_s=1.0)) as running:
        yield running


def post(server, path: str, timeout: float = 30, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", timeout=timeout, **kwargs)


def health_latencies(server, stop: threading.Event, seconds: float = 20.0) -> list[float]:
    """/health round trips, one every 20 ms, until `stop` and at least 5 of them (at most `seconds`)."""
    latencies, deadline = [], time.monotonic() + seconds
    with httpx.Client(timeout=5) as http:
        while (not stop.is_set() or len(latencies) < 5) and time.monotonic() < deadline:
            start = time.monotonic()
            assert http.get(f"{server.base_url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    return latencies


def test_a_body_over_the_limit_is_refused_unread_while_others_are_served(server):
    declared = post(server, "/v1/completions", content=b"x" * (4 * MAX_BODY),
                    headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "limit" in declared.json()["error"]["message"]

    def chunks():  # no declared length: refused once the limit is passed, the rest never read
        for _ in range(2000):
            yield b"y" * 32768

    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        watching = pool.submit(health_latencies, server, stop)
        start = time.monotonic()
        try:
            streamed = post(server, "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            status = streamed.status_code
        except httpx.HTTPError:  # the server closed the connection while the client still sent
            status = 413
        refused_after = time.monotonic() - start
        stop.set()
        latencies = watching.result()
    assert status == 413 and refused_after < 10
    assert latencies and max(latencies) < 0.1, max(latencies)
    ok = post(server, "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200


def test_a_half_sent_body_gets_408_in_time(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\":")
        start = time.monotonic()
        reply = sock.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408") and "did not arrive" in reply
    assert time.monotonic() - start < 5


def read_reply(sock) -> bytes:
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    return reply


@pytest.mark.parametrize("base", [H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])
def test_headers_that_never_finish_get_408_and_the_connection_closes(target, base):
    """A client sending its headers a byte at a time (or stopping halfway) is cut off once the header time
    runs out, counted from its first byte, while other clients are served; a kept-alive connection's next
    request gets a header time of its own, so a pause between requests is not cut."""
    llm = LLM(target, device="cpu", num_kv_pages=64, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL), http=header_timeout_protocol(1.0, base)) as limited:
        host, port = limited.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            reply = read_reply(sock)
        assert reply.startswith(b"HTTP/1.1 408") and b"headers took too long" in reply
        assert 0.9 < time.monotonic() - start < 5
        with socket.create_connection((host, int(port)), timeout=10) as sock:  # a byte every 0.2 s
            start = time.monotonic()
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 100:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.2)
            assert time.monotonic() - start < 5
        with httpx.Client(base_url=limited.base_url, timeout=10) as http:  # one kept-alive connection
            assert http.get("/health").status_code == 200
            time.sleep(1.5)  # longer than the header time, shorter than uvicorn's keep-alive (5 s)
            answer = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3,
                                                        "ignore_eos": True})  # (sampled: an end token may come first)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_a_long_prompt_is_tokenized_off_the_event_loop(target):
    """Tokenizing a 1 MiB prompt (refused afterwards for its length; its tokenizing alone takes longer than the
    bound) leaves /health answering at once."""
    llm = LLM(target, device="cpu", num_kv_pages=64, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL, max_body_bytes=8 << 20)) as big:
        stop = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            watching = pool.submit(health_latencies, big, stop)
            reply = post(big, "/v1/completions", json={"model": MODEL, "prompt": "ab " * 350_000, "max_tokens": 1})
            stop.set()
            latencies = watching.result()
    assert reply.status_code == 400 and "context length" in reply.json()["error"]["message"]
    assert latencies and max(latencies) < 0.1, max(latencies)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "caf\ud800e"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "caf\ud800e"}]}),
])
def test_text_that_cannot_be_encoded_gets_a_400(server, path, body):
    raw = json.dumps({"model": MODEL, "max_tokens": 3, **body})  # the surrogate as JSON's \ud800 escape
    reply = post(server, path, content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid Unicode" in reply.json()["error"]["message"]


def test_a_client_leaving_a_whole_answer_leaves_no_traceback(server, caplog):
    uvicorn_log = logging.getLogger("uvicorn.error")  # where an exception in a handler is logged; not propagated
    uvicorn_log.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with pytest.raises(httpx.TimeoutException):
                post(server, "/v1/completions", json={"model": MODEL, "prompt": "go on", "max_tokens": 400,
                                                      "ignore_eos": True, "temperature": 0}, timeout=0.3)
        time.sleep(1.0)  # the aborts run
    uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.exc_info or "InvalidStateError" in r.getMessage()]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# (library SamplingParams arguments, the same request as server fields, what the refusal names)
SAMPLING_CASES = [
    (dict(temperature=float("inf")), {"temperature": float("inf")}, "temperature"),
    (dict(temperature=-1.0), {"temperature": -1.0}, "temperature"),
    (dict(temperature=1000.0), {"temperature": 1000.0}, "temperature"),
    (dict(temperature=True), {"temperature": True}, "temperature"),
    (dict(top_p=0.0), {"top_p": 0.0}, "top_p"),
    (dict(top_p=float("nan")), {"top_p": float("nan")}, "top_p"),
    (dict(top_k=-2), {"top_k": -2}, "top_k"),
    (dict(top_k=2.5), {"top_k": 2.5}, "top_k"),
    (dict(min_p=1.5), {"min_p": 1.5}, "min_p"),
    (dict(min_p=-0.1), {"min_p": -0.1}, "min_p"),
    (dict(stop=""), {"stop": ""}, "stop"),
    (dict(stop=[""]), {"stop": [""]}, "stop"),
    (dict(stop=["s"] * 33), {"stop": ["s"] * 33}, "stop"),
    (dict(stop=["x" * 513]), {"stop": ["x" * 513]}, "stop"),
    (dict(seed=-1), {"seed": -1}, "seed"),
    (dict(seed="7"), {"seed": "7"}, "seed"),
    (dict(ignore_eos="no"), {"ignore_eos": "no"}, "ignore_eos"),
    (dict(max_new_tokens=0), {"max_tokens": 0}, "max"),
    (dict(max_new_tokens=1.5), {"max_tokens": 1.5}, "max"),
]


@pytest.mark.parametrize("library, fields, names", SAMPLING_CASES, ids=[str(c[1])[:40] for c in SAMPLING_CASES])
def test_the_server_refuses_what_the_library_refuses(server, library, fields, names):
    with pytest.raises(ValueError, match=names):
        SamplingParams(**library)
    for path, prompt in (("/v1/completions", {"prompt": "hi"}),
                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        raw = json.dumps({"model": MODEL, **prompt, **fields})  # inf and nan as JSON's Infinity and NaN
        reply = post(server, path, content=raw, headers={"content-type": "application/json"})
        assert reply.status_code == 400, (path, reply.text)
        assert names in reply.text


def test_token_ids_are_integers_not_booleans(server):
    reply = post(server, "/v1/completions", json={"model": MODEL, "prompt": [True, 5], "max_tokens": 2})
    assert reply.status_code == 400


def test_concurrent_scrapes_all_get_the_engines_metrics(target):
    with ProcessServer("--target", target, "--no-drafter", "--device", "cpu", "--served-model-name", MODEL,
                       "--num-kv-pages", "64", "--page-size", "4") as served:
        def scrape() -> tuple[float, str]:
            start = time.monotonic()
            text = httpx.get(f"{served.base_url}/metrics", timeout=20).text
            return time.monotonic() - start, text

        with ThreadPoolExecutor(6) as pool:
            scrapes = list(pool.map(lambda _: scrape(), range(6)))
    assert all("specdec_kv_pages_in_use" in text for _, text in scrapes)
    assert max(seconds for seconds, _ in scrapes) < 5


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["sigterm", "sigint", "sigterm-to-the-group"])
def test_shutdown_past_the_grace_period_ends_every_answer_cleanly(target, sig, group):
    """A signal to the server's process alone or to its process group (the engine process too), with answers
    longer than the grace period: each stream ends with an error event and [DONE], each whole answer with
    a JSON error; the server exits 0 and leaks nothing (no semaphore left to the resource tracker)."""
    with ProcessServer("--target", target, "--no-drafter", "--device", "cpu", "--served-model-name", MODEL,
                       "--num-kv-pages", "512", "--page-size", "4", "--timeout-graceful-shutdown", "1",
                       new_session=group) as served:
        long = {"model": MODEL, "prompt": "go", "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            whole = pool.submit(http.post, f"{served.base_url}/v1/completions", json=long)
            with http.stream("POST", f"{served.base_url}/v1/completions", json={**long, "stream": True}) as stream:
                lines = stream.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                served.signal(sig, group)
                rest = [line for line in lines if line.startswith("data:")]
            answer = whole.result()
        assert served.wait(60) == 0
        log = served.output()
    assert "leaked" not in log and "Traceback" not in log, log[-2000:]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and "shutting down" in events[-2], events[-3:]
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]


def test_nothing_after_a_finished_output_counts():
    """The server ends a request (shutdown) while the engine still sends the tokens of earlier steps."""
    from specdec.server.async_engine import merge
    from specdec.server.engine_loop import RequestOutput

    merged = merge([RequestOutput("a", [1]), RequestOutput("", [], True, "abort", "shutting down"),
                    RequestOutput("b", [2])])
    assert merged.finished and merged.finish_reason == "abort" and merged.text == "a" and merged.token_ids == [1]

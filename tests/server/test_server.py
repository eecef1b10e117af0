"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 and the official `openai`
client. Streamed and whole answers equal the library's output; bad input gets a 4xx; a load of
cancelled, invalid and valid requests over a pool small enough to preempt leaves every output exact
and every KV page back in the pool."""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoConfig

from specdec import LLM, SamplingParams
from specdec.engine.prompts import encode_chat
from specdec.engine.request import Request
from specdec.engine.structured_output import StructuredOutput
from specdec.server.async_engine import ThreadedEngine
from specdec.server.openai_api import build_app
from tests.conftest import build_tiny_model_with_tokenizer
from tests.drafter_helpers import build_random_drafter
from tests.server_helpers import ProcessServer, ThreadServer
from tests.tokenizer_helpers import CHAT_TEMPLATE

MODEL = "tiny"
PAGES = 48  # of 4 slots: about a dozen of the load test's requests at once, so a full batch preempts
PROMPTS = ["The cache holds pages", "def add(a, b):", "Write a haiku about tokens.", "12 + 30 =",
           "Speculative decoding drafts a block", "SELECT name FROM users"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    target = build_tiny_model_with_tokenizer(root / "target", chat_template=CHAT_TEMPLATE)
    build_random_drafter(root / "drafter", AutoConfig.from_pretrained(target), block_size=4)
    return str(target), str(root / "drafter")


@pytest.fixture(scope="module")
def reference(model_dirs):
    """The library with room to spare: what every answer must equal."""
    return LLM(*model_dirs, device="cpu", num_kv_pages=512, page_size=4)


# a chain's lookahead (4 slots): a tree's (64) would take most of the small pool
SMALL_POOL = dict(num_kv_pages=PAGES, page_size=4, max_num_seqs=16, max_prefill_tokens=64, verify="chain")


@pytest.fixture(scope="module")
def server(model_dirs):
    """The engine on a thread of the test's process: the tests can look inside it and inject failures."""
    llm = LLM(*model_dirs, device="cpu", **SMALL_POOL)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL)) as running:
        running.llm = llm
        yield running


@pytest.fixture(scope="module")
def served(model_dirs):
    """`specdec-serve` as users run it: the engine in a process of its own, behind the command line."""
    target, drafter = model_dirs
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_POOL.items()]
    with ProcessServer("--target", target, "--drafter", drafter, "--device", "cpu", "--served-model-name", MODEL,
                       *args) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def library_text(reference, prompt, chat, **params) -> tuple[str, str, int]:
    [result] = reference.generate([prompt], SamplingParams(**params), chat=chat)
    return result.text, result.finish_reason, len(result.token_ids)


def assert_pools_full(server, timeout_s=30.0):
    """Every page of target and drafter back (aborts reach the engine thread a moment after a disconnect)."""
    engine = server.llm.engine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (engine.pool.num_free == engine.pool.num_pages and engine.drafter.pool.num_free == engine.drafter.pool.num_pages
                and engine.scheduler.idle):
            return
        time.sleep(0.05)
    raise AssertionError(f"pages still held: target {engine.pool.num_pages - engine.pool.num_free}, drafter "
                         f"{engine.drafter.pool.num_pages - engine.drafter.pool.num_free}")


# ---- answers equal the library's -------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_and_whole_answers_equal_the_library(server, client, reference, chat):
    for i, prompt in enumerate(PROMPTS[:3]):
        params = dict(max_new_tokens=12 + 5 * i, temperature=0.0) if i < 2 else dict(
            max_new_tokens=20, temperature=0.8, seed=7)
        want, reason, tokens = library_text(reference, prompt, chat, **params)
        kwargs = dict(model=MODEL, max_tokens=params["max_new_tokens"], temperature=params["temperature"],
                      seed=params.get("seed"))
        if chat:
            messages = [{"role": "user", "content": prompt}]
            whole = client.chat.completions.create(messages=messages, **kwargs)
            assert whole.choices[0].message.content == want and whole.choices[0].message.role == "assistant"
            chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                         stream_options={"include_usage": True}, **kwargs))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            whole = client.completions.create(prompt=prompt, **kwargs)
            assert whole.choices[0].text == want
            chunks = list(client.completions.create(prompt=prompt, stream=True,
                                                    stream_options={"include_usage": True}, **kwargs))
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == want
        assert whole.choices[0].finish_reason == reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason
        assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == tokens
        assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0
    assert_pools_full(server)


def test_stop_strings_end_the_answer_where_the_library_does(server, client, reference):
    """The server matches stop strings on its side of the engine (which ships token ids): same text and
    token count as the library, and the engine's request, which ran on past the stop, is aborted."""
    aborts_before = finished_count(server, "abort")
    free, _, _ = library_text(reference, PROMPTS[1], False, max_new_tokens=30)
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].strip())
    want, reason, tokens = library_text(reference, PROMPTS[1], False, max_new_tokens=30, stop=[stop])
    assert reason == "stop" and stop not in want
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=[stop])
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=30, temperature=0, stop=stop,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == want and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == tokens
    assert_pools_full(server)
    assert finished_count(server, "abort") == aborts_before  # the metrics count those as stops


def test_the_stop_string_is_kept_when_asked_and_named_as_the_stop_reason(server, client, reference):
    """vLLM's include_stop_str_in_output and stop_reason: the text ends with the stop string matched, which each
    choice names (whole and streamed, chat and completions); an answer that ran to its length names none."""
    free, _, _ = library_text(reference, PROMPTS[1], False, max_new_tokens=30)
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].strip())
    cut, _, _ = library_text(reference, PROMPTS[1], False, max_new_tokens=30, stop=[stop])
    kept = dict(max_tokens=30, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True})
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], **kept)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], stream=True, **kept))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == cut + stop
    assert whole.choices[0].stop_reason == chunks[-1].choices[0].stop_reason == stop
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=3,
                                          temperature=0, stop=[stop])
    assert chat.choices[0].finish_reason == "length" and chat.choices[0].stop_reason is None
    assert_pools_full(server)


def test_continuous_usage_stats_count_each_chunks_tokens_so_far(server, client, reference):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage of its choice so far, ending at
    the answer's own usage; without it chunks carry none."""
    _, _, tokens = library_text(reference, PROMPTS[4], False, max_new_tokens=20)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20, temperature=0, stream=True,
                                            stream_options=options))
    counted = [c.usage for c in chunks if c.choices]
    assert len(counted) > 1 and all(u is not None for u in counted)
    assert [u.completion_tokens for u in counted] == sorted(u.completion_tokens for u in counted)
    assert counted[-1].completion_tokens == chunks[-1].usage.completion_tokens == tokens
    assert {u.prompt_tokens for u in counted} == {chunks[-1].usage.prompt_tokens}
    plain = list(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)


def test_a_server_with_overlapped_steps_answers_as_the_library_does(model_dirs):
    """Plain decoding with overlapped steps behind the server (tokens reach the API a step late): the same
    answers as the library stepping in order, concurrent requests and a stop string included, and every
    page back afterwards."""
    target, _ = model_dirs
    reference = LLM(target, None, device="cpu", num_kv_pages=512, page_size=4)
    llm = LLM(target, None, device="cpu", overlap_steps=True, **SMALL_POOL)
    assert llm.engine.overlap
    free, _, _ = library_text(reference, PROMPTS[1], False, max_new_tokens=30)
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].strip())
    cases = [(prompt, dict(max_new_tokens=10 + 3 * i, temperature=0.8 if i % 2 else 0.0, seed=i))
             for i, prompt in enumerate(PROMPTS)] + [(PROMPTS[1], dict(max_new_tokens=30, temperature=0.0, stop=[stop]))]
    expected = [library_text(reference, prompt, False, **params)[:2] for prompt, params in cases]
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL)) as running:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(case):
            prompt, params = case
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=params["max_new_tokens"],
                                            temperature=params["temperature"], seed=params.get("seed"),
                                            stop=params.get("stop"))
            return out.choices[0].text, out.choices[0].finish_reason

        with ThreadPoolExecutor(4) as pool:  # several requests in the engine at once
            assert list(pool.map(ask, cases)) == expected
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (llm.engine.has_unfinished_requests
                                               or llm.engine.pool.num_free != llm.engine.pool.num_pages):
            time.sleep(0.05)
        assert llm.engine.pool.num_free == llm.engine.pool.num_pages and llm.engine.flight is None


def finished_count(server, reason: str) -> float:
    """specdec_requests_total for one finish reason, from /metrics."""
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(f'specdec_requests_total{{finish_reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_logprobs_are_the_librarys_in_each_endpoints_format(server, client, reference):
    """Chat (logprobs + top_logprobs) and completions (logprobs = alternatives): the answer's logprobs equal
    the library's for the same tokens, streamed chunks add up to the whole answer's, and the alternatives
    come most likely first."""
    prompt = PROMPTS[0]
    [lib] = reference.generate([prompt], SamplingParams(max_new_tokens=10, logprobs=3), chat=True)
    messages = [{"role": "user", "content": prompt}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in lib.logprobs], abs=1e-4)
    assert [c.token for c in content] == [reference.tokenizer.decode([t.token]) for t in lib.logprobs]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)  # (a cache hit)
    [lib_text] = reference.generate([prompt], SamplingParams(max_new_tokens=10, logprobs=2), chat=False)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in lib_text.logprobs], abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == completion.choices[0].text or completion.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    assert_pools_full(server)


@pytest.mark.parametrize("body, message", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs must be None or an integer in"),
])
def test_bad_logprobs_requests_get_a_400(server, body, message):
    answer = httpx.post(f"{server.base_url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_are_the_librarys_answers_seeded_with_seed_plus_j(server, client, reference, stream):
    """n = 3 sampled answers: choice j is the library's single answer seeded with seed + j (whole and streamed,
    each streamed chunk naming its choice); usage counts the prompt once and every choice's tokens."""
    prompt = PROMPTS[2]
    want = [library_text(reference, prompt, True, max_new_tokens=12, temperature=0.9, seed=40 + j) for j in range(3)]
    messages = [{"role": "user", "content": prompt}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0.9, seed=40, n=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        texts, reasons = ["", "", ""], [None] * 3
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        answer_usage = chunks[-1].usage
    else:
        whole = client.chat.completions.create(**kwargs)
        assert [c.index for c in whole.choices] == [0, 1, 2]
        texts = [c.message.content for c in whole.choices]
        reasons = [c.finish_reason for c in whole.choices]
        answer_usage = whole.usage
    assert texts == [w[0] for w in want] and reasons == [w[1] for w in want]
    assert answer_usage.completion_tokens == sum(w[2] for w in want)
    assert len(set(texts)) > 1
    assert_pools_full(server)


def test_a_client_leaving_an_answer_of_n_choices_aborts_them_all(server):
    aborts = finished_count(server, "abort")
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 120,
            "temperature": 1.0, "n": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=30) as answer:
        assert answer.status_code == 200
        seen = 0
        for line in answer.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 6:  # the three opening chunks and some text
                break
    assert seen >= 6
    assert_pools_full(server)
    assert finished_count(server, "abort") == aborts + 3  # none ran on to its 120 tokens


def test_penalties_and_bias_are_the_librarys(server, client, reference):
    """presence/frequency (OpenAI's), repetition (vLLM's) and logit_bias reach the engine as the library's."""
    penalties = dict(presence_penalty=0.8, frequency_penalty=1.2, repetition_penalty=1.4)
    want, _, _ = library_text(reference, PROMPTS[0], False, max_new_tokens=12, temperature=0.0, **penalties,
                              logit_bias={30: 2.0})
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                       presence_penalty=0.8, frequency_penalty=1.2, logit_bias={"30": 2.0},
                                       extra_body={"repetition_penalty": 1.4})
    assert answer.choices[0].text == want
    assert want != library_text(reference, PROMPTS[0], False, max_new_tokens=12, temperature=0.0)[0]
    bad = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                 "logit_bias": {"ten": 1.0}})
    assert bad.status_code == 400 and "logit_bias" in bad.json()["error"]["message"]
    assert_pools_full(server)


def test_min_p_is_the_librarys(server, client, reference):
    """vLLM's min_p reaches the engine as the library's: a seeded sampled answer equals the library's, which
    min_p changes."""
    sampled = dict(max_new_tokens=12, temperature=1.0, seed=11)
    want = library_text(reference, PROMPTS[0], False, **sampled, min_p=0.3)
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=11,
                                       extra_body={"min_p": 0.3})
    assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens) == want
    assert want[0] != library_text(reference, PROMPTS[0], False, **sampled)[0]
    bad = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "min_p": 2.0})
    assert bad.status_code == 400 and "min_p" in bad.json()["error"]["message"]
    assert_pools_full(server)


def test_stop_token_ids_and_min_tokens_are_the_librarys(server, client, reference):
    """vLLM's stop_token_ids and min_tokens reach the engine as the library's: the answer ends at its first stop
    token id, and none comes before the min_tokens-th token."""
    free = reference.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))[0]
    stop = free.token_ids[5]
    for extra in (dict(stop_token_ids=[stop]), dict(stop_token_ids=[stop], min_tokens=free.token_ids.index(stop) + 2)):
        want = library_text(reference, PROMPTS[0], False, max_new_tokens=16, temperature=0.0, **extra)
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                           extra_body=extra)
        assert (answer.choices[0].text, answer.choices[0].finish_reason, answer.usage.completion_tokens) == want
    assert library_text(reference, PROMPTS[0], False, max_new_tokens=16, temperature=0.0,
                        stop_token_ids=[stop])[2] == free.token_ids.index(stop) + 1
    bad = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                                 "min_tokens": 3})
    assert bad.status_code == 400 and "min_tokens" in bad.json()["error"]["message"]
    assert_pools_full(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_returns_the_prompt_and_its_logprobs(server, client, reference, stream):
    """Completions' echo (what lm-evaluation-harness's loglikelihood asks): the text starts with the prompt,
    the logprobs with the prompt's tokens (the first without one), each the library's prompt logprob."""
    prompt = PROMPTS[4]
    ids = reference.tokenizer.encode(prompt)
    [lib] = reference.generate([ids], SamplingParams(max_new_tokens=2, prompt_logprobs=1, logprobs=1))
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        token_logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                          for lp in c.choices[0].logprobs.token_logprobs]
    else:
        answer = client.completions.create(**kwargs)
        text, token_logprobs = answer.choices[0].text, answer.choices[0].logprobs.token_logprobs
        assert answer.choices[0].logprobs.top_logprobs[0] is None
    assert text == reference.tokenizer.decode(ids) + lib.text
    assert token_logprobs[0] is None and len(token_logprobs) == len(ids) + 2
    assert token_logprobs[1:len(ids)] == pytest.approx([e.logprob for e in lib.prompt_logprobs[1:]], abs=1e-4)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    assert_pools_full(server)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_list_of_prompts_gets_each_prompts_answers_in_order(server, client, reference, stream):
    """A batch of completions prompts (as lm-evaluation-harness sends them): prompt i's answer j is choice i * n + j,
    the library's answer to that prompt seeded with seed + j, echoed after that prompt; usage counts each prompt
    once and every answer's tokens."""
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1]]
    want = [library_text(reference, p, False, max_new_tokens=10, temperature=0.9, seed=40 + j)
            for p in prompts for j in range(2)]
    echoes = [reference.tokenizer.decode(reference.tokenizer.encode(p)) for p in prompts for _ in range(2)]
    kwargs = dict(model=MODEL, prompt=prompts, max_tokens=10, temperature=0.9, seed=40, n=2, echo=True)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        texts, reasons = [""] * 6, [None] * 6
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        answer_usage = chunks[-1].usage
    else:
        whole = client.completions.create(**kwargs)
        assert [c.index for c in whole.choices] == list(range(6))
        texts, reasons = [c.text for c in whole.choices], [c.finish_reason for c in whole.choices]
        answer_usage = whole.usage
    assert texts == [echo + w[0] for echo, w in zip(echoes, want)] and reasons == [w[1] for w in want]
    assert answer_usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)
    assert answer_usage.completion_tokens == sum(w[2] for w in want)
    assert_pools_full(server)


def test_a_list_of_token_id_prompts_answers_each_as_alone(server, client, reference):
    ids = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]
    alone = [client.completions.create(model=MODEL, prompt=one, max_tokens=8, temperature=0).choices[0].text
             for one in ids]
    together = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in together.choices] == alone and len(set(alone)) > 1
    assert_pools_full(server)


def metric_value(server, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_a_second_turn_reports_its_cached_prompt_tokens(server, client, reference):
    """A conversation's second turn resends the first: its answer equals the library's, its usage says how
    many prompt tokens came from the prefix cache, and /metrics counts the hits."""
    system = {"role": "system", "content": "You answer briefly. " * 6}
    hits_before = metric_value(server, "specdec_prefix_cache_hits_total")
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Hi"}],
                                           max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages = [system, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And then?"}]
    second = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    cached = second[-1].usage.prompt_tokens_details.cached_tokens
    assert cached >= 4 * 20 and cached % 4 == 0 and cached < second[-1].usage.prompt_tokens
    want, _, _ = library_text(reference, encode_chat(reference.prompt_encoder, messages), False, max_new_tokens=8)
    assert "".join(c.choices[0].delta.content or "" for c in second if c.choices) == want
    assert metric_value(server, "specdec_prefix_cache_hits_total") >= hits_before + cached
    assert_pools_full(server)


def test_tokenize_gives_the_ids_each_endpoint_runs_and_detokenize_reverses_them(server, client, reference):
    """/tokenize (vLLM's): a completions prompt's ids, and chat messages' as the chat endpoint renders them (the
    prompt tokens its usage counts); /detokenize turns ids back into text; both check the model and their input."""
    url = server.base_url
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": PROMPTS[3]}).json()
    assert ids["tokens"] == reference.tokenizer.encode(PROMPTS[3]) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == server.llm.engine.limits.max_context
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == encode_chat(reference.prompt_encoder, messages)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert answer.usage.prompt_tokens == chat["count"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == reference.tokenizer.decode(ids["tokens"]) and text.strip() == PROMPTS[3].strip()
    for path, body, status, words in [
        ("/tokenize", {"prompt": "x", "messages": messages}, 400, "either prompt"),
        ("/tokenize", {"model": MODEL}, 400, "either prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/detokenize", {"tokens": [5, 10**6]}, 400, "vocabulary"),
        ("/detokenize", {"tokens": ["5"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5], "model": "gpt-9"}, 404, "does not exist"),
    ]:
        refused = httpx.post(f"{url}{path}", json=body)
        assert refused.status_code == status and words in refused.json()["error"]["message"], (body, refused.text)
    assert_pools_full(server)


def test_chat_options_render_as_the_librarys(server, client, reference):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs: /tokenize and the chat
    endpoint render messages as the library does with them, the answer continues the assistant's last message, and
    an option that cannot apply is a 400 naming it."""
    url = server.base_url
    messages = [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": "The answer is"}]
    options = dict(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"unused": 1})
    ids = encode_chat(reference.prompt_encoder, messages, add_generation_prompt=False, continue_final_message=True)
    assert reference.tokenizer.decode(ids).endswith("The answer is")
    assert httpx.post(f"{url}/tokenize", json={"messages": messages, **options}).json()["tokens"] == ids
    [want] = reference.generate([ids], SamplingParams(max_new_tokens=6))
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=options)
    assert answer.usage.prompt_tokens == len(ids) and answer.choices[0].message.content == want.text
    for body, option in [({"messages": messages, "continue_final_message": True}, "continue_final_message"),
                         ({"messages": messages[:1], "add_generation_prompt": False, "continue_final_message": True},
                          "continue_final_message"),
                         ({"messages": messages, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]:
        refused = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == option, refused.text
    assert_pools_full(server)


def test_a_model_is_retrieved_by_its_name(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def cached_tokens_of(client, messages) -> int:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    return answer.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("host", ["server", "served"])
def test_a_prefix_cache_reset_makes_the_next_turn_prefill_whole(host, request):
    """POST /reset_prefix_cache (the engine on a thread, and in its own process): what no request holds leaves
    the cache, so the same conversation finds nothing cached until it has run again."""
    running = request.getfixturevalue(host)
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": f"You answer briefly ({host}). " * 6}, {"role": "user", "content": "Hi"}]
    cached_tokens_of(client, messages)
    assert cached_tokens_of(client, messages) > 0
    reset = httpx.post(f"{running.base_url}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json()["dropped_pages"] > 0
    assert cached_tokens_of(client, messages) == 0
    assert cached_tokens_of(client, messages) > 0


def test_a_prefix_cache_reset_on_a_stopped_engine_is_a_503(model_dirs):
    engine = ThreadedEngine(LLM(*model_dirs, device="cpu", **SMALL_POOL))
    with ThreadServer(build_app(engine, MODEL)) as running:
        asyncio.run(engine.shutdown())
        answer = httpx.post(f"{running.base_url}/reset_prefix_cache", timeout=30)
    assert answer.status_code == 503 and "not running" in answer.json()["error"]["message"]


def test_models_health_and_metrics(server, client):
    [model] = client.models.list().data
    assert model.id == MODEL and model.owned_by == "specdec"
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in ("specdec_requests_total", "specdec_generation_tokens_total", "specdec_time_to_first_token_seconds",
                 "specdec_time_per_output_token_seconds", "specdec_acceptance_length_bucket",
                 'specdec_kv_pages_in_use{cache="target"}', "specdec_requests_waiting", "specdec_preemptions_total"):
        assert name in text, name
    assert 'specdec_requests_total{finish_reason="length"}' in text



def test_a_streamed_answer_counts_the_servers_time_to_first_token(server, client):
    """/metrics has the time from a streamed request's handler to its first text, beside the engine's own: one
    observation per streamed answer, never shorter than the engine's for the same request."""
    def totals():
        return {name: (metric_value(server, f"{name}_sum"), metric_value(server, f"{name}_count"))
                for name in ("specdec_server_time_to_first_token_seconds", "specdec_time_to_first_token_seconds")}

    before = totals()
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    after = totals()
    (server_s, server_n), (engine_s, engine_n) = ((after[k][0] - before[k][0], after[k][1] - before[k][1])
                                                  for k in after)
    assert server_n == engine_n == 1
    assert server_s >= engine_s > 0

# ---- bad input: 4xx with an OpenAI error, never a 5xx --------------------------------------------------
LONG_PROMPT = " ".join(["tokens"] * 600)  # over the tiny model's 512-token context


def bad_bodies() -> list[tuple[str, dict | str, int, str]]:
    """(path, body, status, words the message must have)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    done = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    return [
        ("/v1/completions", "{not json", 400, "not valid JSON"),
        ("/v1/completions", {**done, "model": "gpt-9"}, 404, "does not exist"),
        ("/v1/chat/completions", {**chat, "model": "gpt-9"}, 404, "does not exist"),
        ("/v1/completions", {**done, "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {**done, "temperature": "hot"}, 400, "temperature"),
        ("/v1/chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("/v1/chat/completions", {**chat, "top_k": -5}, 400, "top_k"),
        ("/v1/chat/completions", {**chat, "seed": -1}, 400, "seed"),
        ("/v1/chat/completions", {**chat, "n": 0}, 400, "n must be"),
        ("/v1/chat/completions", {**chat, "n": 65}, 400, "n must be"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, "logprobs"),
        ("/v1/completions", {**done, "logprobs": 21}, 400, "logprobs"),
        ("/v1/chat/completions", {**chat, "stop": [""]}, 400, "stop"),
        ("/v1/chat/completions", {k: v for k, v in chat.items() if k != "messages"}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        ("/v1/completions", {**done, "prompt": LONG_PROMPT}, 400, "context length"),
        ("/v1/completions", {**done, "max_tokens": 600}, 400, "context length"),
        ("/v1/completions", {**done, "max_tokens": 300}, 400, "KV pages"),
        ("/v1/completions", {**done, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**done, "prompt": ""}, 400, "empty"),
        ("/v1/completions", {**done, "prompt": [5, 10**6]}, 400, "vocabulary"),
        ("/v1/completions", {**done, "prompt": ["a", ""]}, 400, "prompt 1: "),
        ("/v1/completions", {**done, "prompt": [[5, 6], [5, 10**6]]}, 400, "prompt 1: "),
        ("/v1/completions", {**done, "prompt": ["a", "b", LONG_PROMPT]}, 400, "prompt 2: this model's maximum context"),
        ("/v1/completions", {**done, "prompt": ["a"] * 513, "n": 2}, 400, "several requests"),
    ]


def test_bad_input_gets_an_openai_error_and_a_4xx(server):
    for path, body, status, words in bad_bodies():
        content = body if isinstance(body, str) else json.dumps(body)
        r = httpx.post(f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert words.lower() in error["message"].lower(), (body, error)
        assert set(error) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert_pools_full(server)


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)


# ---- failures stay with their request --------------------------------------------------------------
def test_a_request_failing_inside_the_engine_fails_alone(server, client, reference, monkeypatch):
    poisoned = server.llm.tokenizer.encode(PROMPTS[4])
    original = Request.commit_many

    def commit_many(request, tokens, logprobs=None):
        if request.prompt_ids == poisoned and len(request.output_ids) >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(request, tokens, logprobs)

    monkeypatch.setattr(Request, "commit_many", commit_many)
    want = [library_text(reference, p, False, max_new_tokens=16)[0] for p in PROMPTS[:2]]
    results = {}

    def ask(i, prompt):
        try:
            results[i] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        except openai.APIStatusError as err:
            results[i] = err

    threads = [threading.Thread(target=ask, args=(i, p)) for i, p in enumerate([PROMPTS[0], PROMPTS[4], PROMPTS[1]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert isinstance(results[1], openai.InternalServerError) and "UnicodeDecodeError" in str(results[1])
    assert [results[0].choices[0].text, results[2].choices[0].text] == want
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert_pools_full(server)


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(server, client, reference, monkeypatch):
    runner = server.llm.engine.runner
    real, calls = runner.run_block, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_block", failing)
    with pytest.raises(openai.InternalServerError, match="injected step failure"):
        client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0)
    assert_pools_full(server)
    want = library_text(reference, PROMPTS[2], False, max_new_tokens=16)[0]
    assert client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0).choices[0].text == want


def test_a_client_that_disconnects_frees_its_pages(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # a whole answer, given up on
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.3)
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}) as r:
        next(r.iter_lines())  # one event, then hang up
    assert_pools_full(server)
    assert 'specdec_requests_total{finish_reason="abort"}' in httpx.get(f"{server.base_url}/metrics").text


# ---- load: cancellations, invalid requests, preemption ---------------------------------------------
def load_specs(rng: random.Random) -> list[dict]:
    specs = []
    for i in range(24):
        sampled = i % 4 == 3
        specs.append(dict(chat=i % 2 == 0, prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
                          max_tokens=rng.randint(6, 24), temperature=0.8 if sampled else 0.0,
                          seed=i if sampled else None))
    return specs


async def run_load(base_url: str, specs, expected, rng: random.Random, total=300, concurrency=32, deadline_s=240):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
    raw = httpx.AsyncClient(base_url=base_url, timeout=60)
    gate = asyncio.Semaphore(concurrency)
    bad = bad_bodies()
    outcome = {"exact": 0, "cancelled": 0, "invalid": 0, "mismatch": [], "statuses": []}

    async def create(spec, stream):
        kwargs = dict(model=MODEL, max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=spec["seed"],
                      stream=stream)
        if spec["chat"]:
            return await client.chat.completions.create(messages=[{"role": "user", "content": spec["prompt"]}],
                                                        **kwargs)
        return await client.completions.create(prompt=spec["prompt"], **kwargs)

    def piece(chunk, chat):
        return (chunk.choices[0].delta.content or "") if chat else chunk.choices[0].text

    async def one(kind: str, k: int, stream: bool):
        async with gate:
            if kind == "invalid":
                path, body, status, _ = bad[k % len(bad)]
                r = await raw.post(path, content=body if isinstance(body, str) else json.dumps(body),
                                   headers={"content-type": "application/json"})
                outcome["statuses"].append(r.status_code)
                outcome["invalid"] += r.status_code == status
                return
            spec = specs[k % len(specs)]
            if kind == "cancel":
                response = await create({**spec, "max_tokens": 24}, True)
                async for _ in response:
                    break  # one chunk, then hang up mid-stream
                await response.close()
                outcome["cancelled"] += 1
                return
            response = await create(spec, stream)
            if stream:
                text = "".join([piece(c, spec["chat"]) async for c in response if c.choices])
            else:
                text = response.choices[0].message.content if spec["chat"] else response.choices[0].text
            if text == expected[k % len(specs)]:
                outcome["exact"] += 1
            else:
                outcome["mismatch"].append(k % len(specs))

    plan = [(rng.choices(["valid", "cancel", "invalid"], [0.7, 0.2, 0.1])[0], rng.randrange(1000), rng.random() < 0.5)
            for _ in range(total)]
    try:
        await asyncio.wait_for(asyncio.gather(*(one(*p) for p in plan)), deadline_s)
    finally:
        await client.close()
        await raw.aclose()
    return plan, outcome


def metric(text: str, name: str) -> float:
    [value] = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


def finished_by_reason(text: str) -> dict[str, float]:
    """specdec_requests_total by finish_reason, from /metrics."""
    return {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("specdec_requests_total{")}


def test_load_with_cancellations_invalid_requests_and_preemption(served, reference):
    """Against `specdec-serve` itself (the engine in its own process): outputs equal the library's run alone,
    and afterwards every page of target and drafter is back, read from /metrics."""
    rng = random.Random(0)
    specs = load_specs(rng)
    expected = [library_text(reference, s["prompt"], s["chat"], max_new_tokens=s["max_tokens"],
                             temperature=s["temperature"], seed=s["seed"])[0] for s in specs]
    before = finished_by_reason(httpx.get(f"{served.base_url}/metrics").text)  # earlier tests' requests
    plan, outcome = asyncio.run(run_load(served.base_url, specs, expected, rng))
    kinds = [p[0] for p in plan]
    assert outcome["mismatch"] == []
    assert outcome["exact"] == kinds.count("valid") and outcome["cancelled"] == kinds.count("cancel")
    assert outcome["invalid"] == kinds.count("invalid") and all(400 <= s < 500 for s in outcome["statuses"])
    assert 40 <= kinds.count("cancel") and 15 <= kinds.count("invalid")
    deadline = time.monotonic() + 30  # the last aborts reach the engine a moment after the disconnects
    while True:
        metrics = httpx.get(f"{served.base_url}/metrics").text
        used = [metric(metrics, f'specdec_kv_pages_in_use{{cache="{c}"}}') for c in ("target", "drafter")]
        if used == [0, 0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert used == [0, 0]
    assert metric(metrics, "specdec_requests_running") == metric(metrics, "specdec_requests_waiting") == 0
    assert metric(metrics, "specdec_preemptions_total") > 0  # the pool was too small for the load
    finished = {reason: count - before.get(reason, 0) for reason, count in finished_by_reason(metrics).items()}
    assert sum(finished.values()) == kinds.count("valid") + kinds.count("cancel")  # every request ended once
    # a hang-up aborts its request unless the request's own end (24 tokens at most) reaches the engine first
    assert kinds.count("cancel") // 2 <= finished.get("abort", 0) <= kinds.count("cancel")
    assert httpx.get(f"{served.base_url}/health").json() == {"status": "ok"}


# ---- the command line and signals ------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_signal_lets_the_in_flight_request_finish_and_exits_cleanly(model_dirs, sig):
    target, _ = model_dirs
    with ProcessServer("--target", target, "--no-drafter", "--device", "cpu", "--num-kv-pages", "128",
                       "--page-size", "4", "--served-model-name", MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=120, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        server.signal(sig)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert server.wait(60) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.base_url}/health", timeout=2)


def test_command_line_refuses_a_missing_model(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specdec.serve", "--target", str(tmp_path / "nowhere"), "--device", "cpu",
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "nowhere" in r.stderr


def test_logprobs_and_n_cross_the_engine_process(served, reference):
    """`specdec-serve` as users run it (the engine in its own process): logprobs and n answers arrive as the
    library's."""
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    [lib] = reference.generate([PROMPTS[3]], SamplingParams(max_new_tokens=8, logprobs=1), chat=False)
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=1)
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx([t.logprob for t in lib.logprobs], abs=1e-4)
    want = [library_text(reference, PROMPTS[5], False, max_new_tokens=8, temperature=1.0, seed=9 + j)[0]
            for j in range(2)]
    two = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=8, temperature=1.0, seed=9, n=2)
    assert [c.text for c in two.choices] == want


def test_structured_output_crosses_the_engine_process(served, reference):
    """A grammar travels to the engine's process with the sampling settings and constrains the answer there."""
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    spec = {"regex": "[a-z]{2,6}-[0-9]{2}"}
    [lib] = reference.generate([PROMPTS[1]], SamplingParams(max_new_tokens=16, structured_output=StructuredOutput(**spec)))
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                       extra_body={"structured_outputs": spec})
    assert answer.choices[0].text == lib.text and re.fullmatch(spec["regex"], lib.text)

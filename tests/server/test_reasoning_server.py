"""--reasoning-parser: chat answers carry their reasoning apart from their content, whole and streamed alike, read
from where the prompt leaves the answer (inside a think block or not), with tool calls parsed from the content."""

from __future__ import annotations

import json
import random

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.engine.prompts import encode_chat
from specdec.server.async_engine import ThreadedEngine
from specdec.server.openai_api import build_app
from specdec.server.openai_protocol import ResponseShape
from tests.conftest import build_tiny_model_with_tokenizer
from tests.server_helpers import ThreadServer
from tests.tokenizer_helpers import CHAT_TEMPLATE

MODEL = "tiny"
THINKING = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "<think>Let me"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target = build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("reasoning") / "target",
                                             chat_template=CHAT_TEMPLATE)
    llm = LLM(str(target), None, device="cpu", num_kv_pages=128, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL, reasoning_parser="qwen3")) as running:
        running.llm = llm
        yield running


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def library_text(llm, messages, **options) -> str:
    ids = encode_chat(llm.prompt_encoder, messages, **options)
    return llm.generate([ids], SamplingParams(max_new_tokens=10))[0].text


def test_an_answer_inside_a_think_block_its_prompt_opened_is_reasoning(served, client):
    options = dict(add_generation_prompt=False, continue_final_message=True)
    want = library_text(served.llm, THINKING, **options)
    kwargs = dict(model=MODEL, messages=THINKING, max_tokens=10, temperature=0, extra_body=options)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    assert (whole.reasoning_content, whole.content) == (want, "")
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == want
    assert not any(d.content for d in deltas)
    hidden = client.chat.completions.create(**{**kwargs, "extra_body": {**options, "include_reasoning": False}})
    assert hidden.choices[0].message.content == "" and "reasoning_content" not in hidden.choices[0].message.model_extra


def test_an_answer_outside_a_think_block_is_content(served, client):
    messages = THINKING[:1]
    want = library_text(served.llm, messages)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert (answer.choices[0].message.content, answer.choices[0].message.reasoning_content) == (want, None)


@pytest.mark.parametrize("opened", [False, True], ids=["think-in-answer", "think-in-prompt"])
def test_streamed_chunks_add_up_to_the_whole_message_with_tool_calls(opened):
    """Reasoning, content and a tool call, streamed in random pieces: the deltas add up to the whole message."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    text = ("" if opened else "<think>") + "First, add. </thin not yet</think>\nCalling it. " + call
    rng = random.Random(3)
    for _ in range(20):
        whole_shape, stream_shape = (ResponseShape(True, MODEL) for _ in range(2))
        for shape in (whole_shape, stream_shape):
            shape.tool_texts, shape.reasoning_texts, shape.starts_in_reasoning = {}, {}, opened
        whole = whole_shape.whole([(text, "stop", None, None)], {})["choices"][0]
        reasoning, content, calls, at, reason = "", "", [], 0, None
        while at < len(text):
            size = rng.randrange(1, 6)
            last = at + size >= len(text)
            choice = stream_shape.chunk(text[at:at + size], "stop" if last else None)["choices"][0]
            reasoning += choice["delta"].get("reasoning_content", "")
            content += choice["delta"].get("content", "")
            calls += choice["delta"].get("tool_calls", [])
            reason, at = choice["finish_reason"], at + size
        message = whole["message"]
        assert message["reasoning_content"] == reasoning == "First, add. </thin not yet"
        assert (message["content"], content.strip()) == ("Calling it.", "Calling it.")
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 2}]
        assert message["tool_calls"][0]["function"]["name"] == calls[0]["function"]["name"] == "add"
        assert whole["finish_reason"] == reason == "tool_calls"

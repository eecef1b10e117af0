"""Structured output and tools through the official `openai` client against a real server (with a DFlash
drafter): response_format and structured_outputs answers equal the library's plain decoding and validate;
tool_choice "required" and a named function always give valid calls, whole and streamed; tool results go
back through the chat template; bad combinations get a 400 naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoConfig

from specdec import LLM, SamplingParams
from specdec.engine.prompts import encode_chat
from specdec.engine.structured_output import StructuredOutput
from specdec.engine.tool_calls import forced_calls, split_calls
from specdec.server.async_engine import ThreadedEngine
from specdec.server.openai_api import build_app
from tests.conftest import build_tiny_model_with_tokenizer
from tests.drafter_helpers import build_random_drafter
from tests.server_helpers import ThreadServer
from tests.tokenizer_helpers import TOOL_CHAT_TEMPLATE

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
QUESTIONS = ["What is the weather in Paris?", "Plan a trip", "Tell me the time"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-server")
    # tools make long prompts for a 400-token vocabulary
    target = build_tiny_model_with_tokenizer(root / "target", chat_template=TOOL_CHAT_TEMPLATE,
                                             max_position_embeddings=2048)
    build_random_drafter(root / "drafter", AutoConfig.from_pretrained(target), block_size=4)
    return str(target), str(root / "drafter")


@pytest.fixture(scope="module")
def plain(model_dirs):
    """The library without a drafter: what every greedy answer must equal."""
    return LLM(model_dirs[0], None, device="cpu", num_kv_pages=1024, page_size=4)


@pytest.fixture(scope="module")
def server(model_dirs):
    llm = LLM(*model_dirs, device="cpu", num_kv_pages=1024, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL)) as running:
        running.llm = llm
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_answers_validate_and_equal_plain_decoding(client, plain, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    for question in QUESTIONS:
        [want] = plain.generate([question], SamplingParams(
            max_new_tokens=60, structured_output=StructuredOutput(json=SCHEMA)), chat=True)
        kwargs = dict(model=MODEL, messages=chat(question), max_tokens=60, temperature=0,
                      response_format=response_format)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
        else:
            answer = client.chat.completions.create(**kwargs)
            text, reason = answer.choices[0].message.content, answer.choices[0].finish_reason
        assert text == want.text and reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_on_both_endpoints(client):
    answer = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert answer.choices[0].text in ("red", "green", "blue")
    answer = client.chat.completions.create(model=MODEL, messages=chat("A code"), max_tokens=20, temperature=0.8,
                                            seed=4, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", answer.choices[0].message.content)
    answer = client.chat.completions.create(model=MODEL, messages=chat("JSON please"), max_tokens=200, temperature=0,
                                            response_format={"type": "json_object"})
    if answer.choices[0].finish_reason == "stop":  # any object may be longer than the budget
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


def assert_valid_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel"])
def test_forced_tool_choice_always_gives_valid_calls(client, choice, parallel):
    names = ("get_weather", "get_time") if choice == "required" else ("get_time",)
    for i, question in enumerate(QUESTIONS):
        kwargs = dict(model=MODEL, messages=chat(question), max_tokens=150, tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=parallel, temperature=0 if i == 0 else 1.0, seed=i)
        answer = client.chat.completions.create(**kwargs)
        message = answer.choices[0].message
        # parallel calls may go on until max_tokens (a random model need not end them): complete ones count
        assert answer.choices[0].finish_reason == "tool_calls" or parallel and answer.choices[0].finish_reason == "length"
        assert message.content is None or parallel
        assert_valid_calls(message.tool_calls, names)
        if not parallel or choice != "required":
            assert len(message.tool_calls) == 1
        streamed = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [call for c in streamed if c.choices for call in c.choices[0].delta.tool_calls or []]
        assert [d.index for d in deltas] == list(range(len(deltas)))
        assert [(d.function.name, d.function.arguments) for d in deltas] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamed[-1].choices[0].finish_reason == answer.choices[0].finish_reason


def test_the_library_forces_and_reads_tool_calls(plain):
    ids = plain.encode_chat(chat("Weather?"), TOOLS)
    assert '"name": "get_time"' in plain.tokenizer.decode(ids)
    [result] = plain.generate([ids], SamplingParams(max_new_tokens=150, structured_output=forced_calls(
        TOOLS, "get_weather", parallel=False)))
    content, calls = split_calls(result.text)
    assert content is None and [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


def test_tool_results_go_back_through_the_chat_template(server, client):
    conversation = [{"role": "user", "content": "Weather in Oslo?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=4, temperature=0,
                                            tools=TOOLS)
    rendered = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
                {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"}]
    ids = encode_chat(server.llm.prompt_encoder, rendered, TOOLS)
    assert answer.usage.prompt_tokens == len(ids)
    text = server.llm.tokenizer.decode(ids)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}' in text and "sunny, 21 C" in text
    assert '"name": "get_time"' in text  # the tools are in the prompt
    none = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2, tools=TOOLS,
                                          tool_choice="none")
    assert none.usage.prompt_tokens == len(encode_chat(server.llm.prompt_encoder, chat("hi")))  # no tools shown


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "pattern"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "[1]"}}]}]}, "messages", "must be a JSON object"),
], ids=["bad-schema", "no-schema", "both", "bad-regex", "unknown-key", "choice-without-tools", "unknown-function",
        "forced-with-format", "bad-arguments"])
def test_bad_structured_requests_get_a_400_naming_the_field(server, body, param, message):
    request = {"model": MODEL, "messages": chat("hi"), "max_tokens": 4, **body}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=request, timeout=30)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error

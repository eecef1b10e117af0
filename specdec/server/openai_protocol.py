"""The OpenAI API's request bodies (pydantic), their checks, and the JSON the server answers with.

Fields the engine cannot honour (suffix) are refused with a 400 that names the field, rather than silently
ignored; unknown extra fields are ignored, as OpenAI does. `logprobs` are answered in each endpoint's own
format (`ResponseShape`). Structured output comes as OpenAI's `response_format` or as vLLM's
`structured_outputs` (json, json_object, regex, choice, grammar); tools as OpenAI's `tools` + `tool_choice`
(specdec/engine/tool_calls.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from specdec.engine.logprobs import TokenLogprob
from specdec.engine.reasoning import ReasoningText, split_reasoning
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.structured_output import StructuredOutput
from specdec.engine.tool_calls import ToolCallText, forced_calls, split_calls

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share. Numbers and booleans are strict: a value of
    another JSON type ("8", true for a number) is refused, as the library refuses it, never converted."""

    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # an extension (vLLM's): 0 or -1 = off
    min_p: StrictFloat = 0.0  # an extension (vLLM's): drop tokens below min_p times the likeliest; 0 = off
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # an extension (vLLM's)
    stop_token_ids: list[StrictInt] | None = None  # an extension (vLLM's): ids that end the answer as EOS does
    min_tokens: StrictInt = 0  # an extension (vLLM's): no EOS or stop token id before this many output tokens
    skip_special_tokens: StrictBool = True  # an extension (vLLM's): special tokens left out of the text
    include_stop_str_in_output: StrictBool = False  # an extension (vLLM's): the matched stop string ends the text
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0  # an extension (vLLM's)
    logit_bias: dict[str, StrictFloat] | None = None  # {token id as a string: bias}, as OpenAI's
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # an extension (vLLM's): json, json_object, regex, choice or grammar

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def unsupported(self) -> list[str]:
        """Fields set to something the engine cannot do."""
        return []

    def given(self, name: str, defaults: dict | None, fallback):
        """A setting as the request gives it; left out (or null), the model's default, else `fallback`."""
        value = getattr(self, name)
        if value is not None and name in self.model_fields_set:
            return value
        return (defaults or {}).get(name, fallback)

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None

    def logprobs_wanted(self) -> int | None:
        """Alternatives per token the answer carries logprobs with (None: no logprobs)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """Alternatives per prompt token (completions' echo with logprobs; None: none)."""
        return None

    def structured_output(self) -> StructuredOutput | None:
        """What the answer must match (None: anything), from response_format or structured_outputs."""
        given = [name for name in ("response_format", "structured_outputs") if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if not given:
            return None
        try:
            if given[0] == "structured_outputs":
                return StructuredOutput(**self.structured_outputs)
            if self.response_format.type == "json_object":
                return StructuredOutput(json_object=True)
            schema = self.response_format.json_schema
            if schema is None or schema.json_schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            return StructuredOutput(json=schema.json_schema)
        except (TypeError, ValueError) as err:  # TypeError: a key StructuredOutput does not take
            raise APIError(400, str(err), param=given[0]) from err

    def sampling_params(self, max_new_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """Raises ValueError naming every bad value (SamplingParams checks them all). `defaults`: the model's settings
        for what the request leaves out (`specdec/server/sampling_defaults.py`)."""
        top_k = self.given("top_k", defaults, 0)
        return SamplingParams(max_new_tokens=max_new_tokens, logprobs=self.logprobs_wanted(), n=self.n,
                              structured_output=self.structured_output(),
                              prompt_logprobs=self.prompt_logprobs_wanted(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.given("repetition_penalty", defaults, 1.0),
                              logit_bias=self.token_bias(),
                              temperature=self.given("temperature", defaults, DEFAULT_TEMPERATURE),
                              top_p=self.given("top_p", defaults, 1.0), top_k=0 if top_k == -1 else top_k,
                              min_p=self.given("min_p", defaults, 0.0),
                              seed=self.seed, stop=None if self.stop in (None, []) else self.stop,
                              ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
                              min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(GenerationFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None  # alternatives per token (OpenAI allows 5; up to 20 here, as vLLM)
    suffix: str | None = None

    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None

    def unsupported(self) -> list[str]:
        found = super().unsupported()
        if self.suffix:
            found.append("suffix")
        return found


class TextPart(BaseModel):
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise APIError(400, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                           param="messages")
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as chat templates read it: tool calls' arguments as objects (templates write them with
        tojson; a JSON string would be quoted twice)."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        for name in ("tool_call_id", "name"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        return message


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, f"a tool call's arguments must be a JSON object, got {text[:80]!r}", param="messages")
    return value


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(BaseModel):
    """vLLM's options of how chat messages are rendered (`specdec.engine.prompts.encode_chat`)."""

    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None

    def template_options(self) -> dict:
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message, template_kwargs=self.chat_template_kwargs)


class ChatCompletionRequest(GenerationFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    include_reasoning: StrictBool = True  # an extension (vLLM's): with a reasoning parser, send the reasoning

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_dicts(self) -> list[dict] | None:
        """The tools the model is shown (None: none; tool_choice "none" shows none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def structured_output(self) -> StructuredOutput | None:
        """With tool_choice "required" or a named function, the answer is nothing but calls (`forced_calls`)."""
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if choice in (None, "none", "auto"):
            return super().structured_output()
        name = None if choice == "required" else choice.function.name
        if name is not None and name not in {t.function.name for t in self.tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                           param="tool_choice")
        if super().structured_output() is not None:
            raise APIError(400, "tool_choice \"required\" or a named function cannot be combined with "
                                "response_format or structured_outputs", param="tool_choice")
        try:
            return forced_calls(self.tool_dicts, name, self.parallel_tool_calls and name is None)
        except ValueError as err:
            raise APIError(400, f"the tools' parameters are not a usable JSON schema: {err}", param="tools") from err

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize (vLLM's): the ids of a completions prompt, or of chat messages (with the tools shown to the
    model and the chat template options) as the chat endpoint renders them."""

    model: str | None = None
    prompt: str | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None

    def chat(self, model: str) -> ChatCompletionRequest | None:
        """The chat request whose prompt these messages make (None: a completions prompt was given)."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt (as /v1/completions takes it) or messages (as "
                                "/v1/chat/completions takes them)", param="prompt")
        if self.messages is None:
            return None
        return ChatCompletionRequest(model=model, messages=self.messages, tools=self.tools,
                                     **self.model_dump(include=set(ChatTemplateFields.model_fields)))


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back into text."""

    model: str | None = None
    tokens: list[StrictInt]


class ResponseShape:
    """The JSON of one endpoint's answers: whole and streamed. With `token_text` (a token id's text), answers
    carry the logprobs they are given, in the endpoint's format."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] | None = None):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # completions: where choice i's next token's text starts
        # completions' echo: each choice's prompt, its text and token ids (empty: no echo)
        self.echo: dict[int, tuple[str, list[int]]] = {}
        # chat with tools: each choice's tool calls, parsed out of its text as it comes (None: no tools)
        self.tool_texts: dict[int, ToolCallText] | None = None
        # chat with a reasoning parser: each choice's reasoning apart from its content as it comes (None: no parser),
        # whether the answers start inside a think block their prompt opened, and whether their reasoning is sent
        self.reasoning_texts: dict[int, ReasoningText] | None = None
        self.starts_in_reasoning = False
        self.include_reasoning = True

    def logprobs(self, entries: list[TokenLogprob] | None, index: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, or completions' parallel lists."""
        if self.token_text is None or entries is None:
            return None
        if self.chat:
            def item(token: int, logprob: float) -> dict:
                text = self.token_text(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}
        texts = [self.token_text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.logprob is None else {self.token_text(t): lp for t, lp in e.top}
                                 for e in entries],
                "text_offset": offsets}

    def echoed(self, out, first: bool, index: int = 0) -> tuple[str, list[TokenLogprob] | None]:
        """An output of choice `index`: its text and logprobs, its prompt's before them on the choice's first output
        when echoing (completions' echo: the prompt's first token has no logprob)."""
        if index not in self.echo or not first:
            return out.text, out.logprobs
        prompt_text, prompt_ids = self.echo[index]
        if out.prompt_logprobs is None:
            return prompt_text + out.text, out.logprobs
        head = [TokenLogprob(prompt_ids[0], None), *out.prompt_logprobs[1:]]
        return prompt_text + out.text, head + (out.logprobs or [])

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, choices: list[tuple[str, str, list[TokenLogprob] | None, str | int | None]], usage: dict) -> dict:
        """The whole answer: one choice per (text, finish reason, logprobs, stop reason), in order. The stop reason
        (vLLM's): the stop string or stop token id that ended the choice, else null."""
        if self.chat:
            return self._envelope("chat.completion", [
                {"index": i, **self._message(text, reason), "logprobs": self.logprobs(logprobs, i), "stop_reason": stop}
                for i, (text, reason, logprobs, stop) in enumerate(choices)], usage)
        return self._envelope("text_completion", [
            {"index": i, "text": text, "logprobs": self.logprobs(logprobs, i), "finish_reason": reason,
             "stop_reason": stop}
            for i, (text, reason, logprobs, stop) in enumerate(choices)], usage)

    def first_chunk(self, index: int = 0) -> dict | None:
        """Chat streams open with the assistant's role (as OpenAI's do); completions have no opening chunk."""
        if not self.chat:
            return None
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None,
              index: int = 0, stop_reason: str | int | None = None) -> dict:
        if self.chat:
            delta, finish_reason = self._delta(text, finish_reason, index)
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs, index),
                      "finish_reason": finish_reason, "stop_reason": stop_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs, index),
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        return self._envelope("text_completion", [choice])

    def _message(self, text: str, reason: str) -> dict:
        """A whole chat choice's message and finish reason: with a reasoning parser, its reasoning apart from its
        content; with tools, its calls apart from its content."""
        reasoning = None
        if self.reasoning_texts is not None:
            reasoning, text = split_reasoning(text, self.starts_in_reasoning)
        if self.tool_texts is None:
            message, calls = {"role": "assistant", "content": text}, []
        else:
            content, calls = split_calls(text)
            message = {"role": "assistant", "content": content}
        if self.reasoning_texts is not None and self.include_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return {"message": message, "finish_reason": "tool_calls" if calls and reason == "stop" else reason}

    def _delta(self, text: str, finish_reason: str | None, index: int) -> tuple[dict, str | None]:
        """A chat chunk's delta and finish reason: reasoning apart from content (with a reasoning parser), each tool
        call as one delta once it is complete (with tools), and text that may begin a tag held back until it is
        known."""
        reasoning = ""
        if self.reasoning_texts is not None:
            split = self.reasoning_texts.setdefault(index, ReasoningText(self.starts_in_reasoning))
            reasoning, text = split.feed(text)
            if finish_reason is not None:
                rest = split.finish()
                reasoning, text = reasoning + rest[0], text + rest[1]
            reasoning = reasoning if self.include_reasoning else ""
        found, calls = [], False
        if self.tool_texts is not None:
            parser = self.tool_texts.setdefault(index, ToolCallText())
            before = len(parser.calls)
            text, found = parser.feed(text)
            if finish_reason is not None:
                text += parser.finish()
            calls = bool(parser.calls)
        delta = {"content": text} if text else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if found:
            delta["tool_calls"] = [call.as_openai(before + k) for k, call in enumerate(found)]
        return delta, "tool_calls" if finish_reason == "stop" and calls else finish_reason

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}

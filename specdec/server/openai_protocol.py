"""The OpenAI API's request bodies (pydantic), their checks, and the JSON the server answers with.

Fields the engine cannot honour (suffix, tools, structured output) are refused with a 400 that names the
field, rather than silently ignored; unknown extra fields are ignored, as OpenAI does. `logprobs` are
answered in each endpoint's own format (`ResponseShape`).
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Literal

from pydantic import BaseModel, Field, StrictBool, StrictFloat, StrictInt

from specdec.engine.logprobs import TokenLogprob
from specdec.engine.sampling_params import SamplingParams

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


class GenerationFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share. Numbers and booleans are strict: a value of
    another JSON type ("8", true for a number) is refused, as the library refuses it, never converted."""

    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # an extension (vLLM's): 0 or -1 = off
    n: StrictInt = 1
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # an extension (vLLM's)
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    repetition_penalty: StrictFloat = 1.0  # an extension (vLLM's)
    logit_bias: dict[str, StrictFloat] | None = None  # {token id as a string: bias}, as OpenAI's
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def unsupported(self) -> list[str]:
        """Fields set to something the engine cannot do."""
        return []

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

    def sampling_params(self, max_new_tokens: int) -> SamplingParams:
        """Raises ValueError naming every bad value (SamplingParams checks them all)."""
        top_k = self.top_k if self.top_k is not None else 0
        return SamplingParams(max_new_tokens=max_new_tokens, logprobs=self.logprobs_wanted(), n=self.n,
                              prompt_logprobs=self.prompt_logprobs_wanted(),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty, logit_bias=self.token_bias(),
                              temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if top_k == -1 else top_k,
                              seed=self.seed, stop=None if self.stop in (None, []) else self.stop,
                              ignore_eos=self.ignore_eos)


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


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.type != "text" or part.text is None for part in self.content):
            raise APIError(400, "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                           param="messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    response_format: dict | None = None

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> list[str]:
        found = super().unsupported()
        if self.tools:
            found.append("tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            found.append("response_format (only text)")
        return found

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class ResponseShape:
    """The JSON of one endpoint's answers: whole and streamed. With `token_text` (a token id's text), answers
    carry the logprobs they are given, in the endpoint's format."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str] | None = None):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text_offsets: dict[int, int] = {}  # completions: where choice i's next token's text starts
        self.echo: tuple[str, list[int]] | None = None  # completions' echo: the prompt's text and token ids

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

    def echoed(self, out, first: bool) -> tuple[str, list[TokenLogprob] | None]:
        """An output's text and logprobs, the prompt's before them on a choice's first output when echoing
        (completions' echo: the prompt's first token has no logprob)."""
        if self.echo is None or not first:
            return out.text, out.logprobs
        prompt_text, prompt_ids = self.echo
        if out.prompt_logprobs is None:
            return prompt_text + out.text, out.logprobs
        head = [TokenLogprob(prompt_ids[0], None), *out.prompt_logprobs[1:]]
        return prompt_text + out.text, head + (out.logprobs or [])

    def _envelope(self, obj: str, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def whole(self, choices: list[tuple[str, str, list[TokenLogprob] | None]], usage: dict) -> dict:
        """The whole answer: one choice per (text, finish reason, logprobs), in order."""
        if self.chat:
            return self._envelope("chat.completion", [
                {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": self.logprobs(logprobs, i),
                 "finish_reason": reason} for i, (text, reason, logprobs) in enumerate(choices)], usage)
        return self._envelope("text_completion", [
            {"index": i, "text": text, "logprobs": self.logprobs(logprobs, i), "finish_reason": reason}
            for i, (text, reason, logprobs) in enumerate(choices)], usage)

    def first_chunk(self, index: int = 0) -> dict | None:
        """Chat streams open with the assistant's role (as OpenAI's do); completions have no opening chunk."""
        if not self.chat:
            return None
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None,
              index: int = 0) -> dict:
        if self.chat:
            choice = {"index": index, "delta": {"content": text} if text else {},
                      "logprobs": self.logprobs(logprobs, index), "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": self.logprobs(logprobs, index), "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix cache held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}

"""One streamed chat request, timed from the client's side (`scripts/bench_serve.py`).

Times are `time.perf_counter()` seconds from just before the request is sent:
- TTFT: until the first chunk that carries content (the role-only first chunk does not count; an
  answer with no text at all, an end token first, has its TTFT at its end);
- chunk gaps (ITL per chunk): between consecutive content chunks. A speculative server commits several
  tokens per step and sends them as one chunk, so a gap may stand for several tokens;
- e2e: until the stream ends (after the usage chunk).
Token counts come from the server's usage chunk (`stream_options.include_usage`), not from counting
chunks; a stream without usage is a failure, since none of the per-token numbers could be computed.

The request is the JSON body posted as it is, over httpx (`streaming_client`), and the server-sent events are
read as JSON, as `vllm bench serve` does over aiohttp. The official `openai` client would put its own work
inside every time: its request preparation walks the typed messages at ~0.1 ms per message on a server CPU
(1 ms for a 5-turn conversation, more than the prefix cache leaves of a turn's TTFT), and its pydantic chunk
objects cost ~0.2-0.6 ms of client CPU per chunk (measured on 2 cores) against ~35 us for `json.loads`: a
load generator that keeps up with a server sending 10k+ chunks/s must not be the bottleneck it measures.
A refused request (HTTP 4xx/5xx) is a failed record whose error carries the status and the server's message.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import httpx

from scripts.bench.chat_prompts import ChatPrompt


@dataclass
class RequestRecord:
    prompt_id: str
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    content_chunks: int = 0
    finish_reason: str | None = None
    turn: int = 0  # a conversation's turns count from 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    answer: str = field(default="", repr=False)  # the answer's text: the next turn sends it back (not saved)

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (completion tokens - 1): the decode time per token after the first."""
        if not self.ok or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def per_token_gaps_s(self) -> list[float]:
        """Each chunk gap divided by the request's mean tokens per chunk after the first chunk, taken as
        (completion tokens - 1) / (content chunks - 1): the first chunk is counted as one token, as a
        prefill commits one. Their mean is the request's decode time per token (TPOT but for the wait
        after the last chunk); their spread is the chunks'."""
        if not self.ok or not self.chunk_gaps_s or self.completion_tokens is None or self.completion_tokens < 2:
            return []
        tokens_per_chunk = (self.completion_tokens - 1) / len(self.chunk_gaps_s)
        return [gap / tokens_per_chunk for gap in self.chunk_gaps_s]

    def as_dict(self) -> dict:
        fields = asdict(self)
        del fields["answer"]
        return {**fields, "tpot_s": self.tpot_s}


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None  # sent only when sampling (temperature > 0)
    ignore_eos: bool = False  # a vLLM extension the specdec server also takes: every answer runs to max_tokens


def first_messages(prompt: ChatPrompt) -> list[dict]:
    system = [{"role": "system", "content": prompt.system}] if prompt.system else []
    return system + [{"role": "user", "content": prompt.text}]


def request_body(model: str, messages: list[dict], sampling: SamplingSettings) -> dict:
    """The JSON body of a streamed chat completion."""
    body = dict(model=model, messages=messages, max_tokens=sampling.max_tokens,
                temperature=sampling.temperature, stream=True, stream_options={"include_usage": True})
    if sampling.temperature > 0 and sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    return body


def streaming_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    """The HTTP client requests are streamed through: `base_url`'s /v1, a bearer key (servers that check none
    ignore it), `timeout_s` on each read, no limit on connections (one per request in flight), and no proxy
    from the environment (requests go to base_url and nowhere else)."""
    return httpx.AsyncClient(base_url=f"{base_url.rstrip('/')}/v1/", headers={"Authorization": "Bearer EMPTY"},
                             timeout=timeout_s, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
                             trust_env=False)


class RequestRefused(RuntimeError):
    """The server answered the request with an HTTP error status."""


async def send_conversation(client, model: str, prompt: ChatPrompt, sampling: SamplingSettings,
                            timeout_s: float) -> list[RequestRecord]:
    """Every turn of a conversation in order, each sent with the whole conversation so far once the answer
    before it has arrived; a failed turn ends the conversation. One record per turn sent."""
    messages, records = first_messages(prompt), []
    for turn, follow_up in enumerate((None, *prompt.follow_ups)):
        if follow_up is not None:
            messages = messages + [{"role": "assistant", "content": records[-1].answer},
                                   {"role": "user", "content": follow_up}]
        records.append(await send_chat_request(client, model, prompt, sampling, timeout_s, messages, turn))
        if not records[-1].ok:
            break
    return records


async def send_chat_request(client, model: str, prompt: ChatPrompt, sampling: SamplingSettings,
                            timeout_s: float, messages: list[dict] | None = None, turn: int = 0) -> RequestRecord:
    """Stream one answer through `client` (`streaming_client`) to `messages` (default: the prompt's first turn);
    never raises for a failed request (the record says why), only for cancellation."""
    record = RequestRecord(prompt.id, turn=turn)
    body = request_body(model, messages or first_messages(prompt), sampling)
    start = time.perf_counter()
    try:
        # the client's timeout bounds each read; this bounds the whole answer
        await asyncio.wait_for(read_stream(client, body, record, start), timeout_s)
    except asyncio.TimeoutError:
        record.error = f"no complete answer within {timeout_s:g} s"
    except Exception as err:  # noqa: BLE001 - any failure of one request is a result, not a crash
        record.error = f"{type(err).__name__}: {' '.join(str(err).split())}"[:500]
    if record.error is None and record.completion_tokens is None:
        record.error = "the stream carried no usage chunk (stream_options.include_usage)"
    if record.error is None and record.ttft_s is None:  # an empty answer (an end token first) is still one
        record.ttft_s = record.e2e_s
    record.ok = record.error is None
    return record


async def read_stream(client, body: dict, record: RequestRecord, start: float) -> None:
    last_content, pieces = None, []
    async with client.stream("POST", "chat/completions", json=body) as response:
        if response.is_error:
            raise RequestRefused(f"HTTP {response.status_code}: {error_message(await response.aread())}")
        async for data in sse_data(response.aiter_lines()):
            now = time.perf_counter()
            if data == "[DONE]":
                continue  # the body ends next; reading it to the end keeps the connection reusable
            chunk = json.loads(data)
            if chunk.get("error"):  # a server that fails mid-stream sends an error event
                error = chunk["error"]
                raise StreamError(error.get("message") if isinstance(error, dict) else str(error))
            usage = chunk.get("usage")
            if usage:
                record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason") is not None:
                    record.finish_reason = choice["finish_reason"]
                content = (choice.get("delta") or {}).get("content")
                if not content:
                    continue
                pieces.append(content)
                if last_content is None:
                    record.ttft_s = now - start
                else:
                    record.chunk_gaps_s.append(now - last_content)
                record.content_chunks += 1
                last_content = now
    record.e2e_s = time.perf_counter() - start
    record.answer = "".join(pieces)


def error_message(body: bytes) -> str:
    """An error answer's message (OpenAI's {"error": {"message": ...}}, else the body's text)."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except (ValueError, AttributeError):
        pass
    return body.decode("utf-8", "replace")[:300]


class StreamError(RuntimeError):
    """An error event inside a stream that had started well."""


async def sse_data(lines):
    """The data of each server-sent event (its `data:` lines joined), as soon as the event is complete."""
    data: list[str] = []
    async for line in lines:
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:  # a blank line ends an event
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)

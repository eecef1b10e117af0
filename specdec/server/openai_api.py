"""The OpenAI-compatible HTTP API over an `AsyncEngine`: FastAPI routes, streaming as server-sent events.

    POST /v1/completions, /v1/chat/completions   (stream true/false; completions: one prompt or a list of them)
    GET  /v1/models, /v1/models/{model}, /health, /metrics
    POST /tokenize, /detokenize (vLLM's: a prompt's or chat messages' token ids, and ids back into text)
    POST /reset_prefix_cache (what no running request holds leaves the prefix cache)

Every request is checked before it reaches the engine (model name, sampling values, prompt and
max_tokens against the context and the KV pool), and bad input is answered with an OpenAI-style error
and a 4xx status, never a 5xx. Handlers only wait on their request's outputs; the engine runs on its
own thread. A client that disconnects (mid-stream or while waiting for a whole answer) aborts its
request, which gives its KV pages back at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from specdec.engine.prompt_encoder import PromptEncoder
from specdec.engine.prompts import ChatOptionError, encode_chat, token_ids
from specdec.engine.reasoning import PROMPT_TAIL_TOKENS, REASONING_PARSERS, starts_in_reasoning
from specdec.engine.request_limits import RequestLimits
from specdec.engine.sampling_params import SamplingParams
from specdec.server.api_key import ApiKeyCheck
from specdec.server.async_engine import AsyncEngine
from specdec.server.body_limit import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit
from specdec.server.engine_loop import RequestOutput
from specdec.server.metrics import LATENCY_BUCKETS
from specdec.server.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationFields,
    ResponseShape,
    TokenizeRequest,
    error_body,
    usage,
)

log = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went away (nobody receives it)
MAX_CHOICES = 1024  # a request's answers at most (prompts x n): each is a request of the engine's


def build_app(engine: AsyncEngine, model_name: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, api_key: str | None = None,
              reasoning_parser: str | None = None, sampling_defaults: dict | None = None) -> FastAPI:
    """The API over `engine` (a `ThreadedEngine` or a `ProcessEngine`), serving it as `model_name`. The app
    stops the engine when it shuts down. Request bodies are read within `max_body_bytes` and
    `body_timeout_s` before anything parses them (`body_limit.py`); with `api_key`, only requests that carry it
    get that far (`api_key.py`). With a `reasoning_parser` (one of `REASONING_PARSERS`), chat answers carry their
    reasoning apart from their content (`specdec/engine/reasoning.py`). `sampling_defaults`: the settings a request
    that leaves them out gets (the model's generation config: `sampling_defaults.py`)."""
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {reasoning_parser!r}")
    limits = engine.limits
    prompt_encoder = PromptEncoder(engine.tokenizer)  # a shared system prompt, earlier turns: tokenized once
    started = int(time.time())
    registry = CollectorRegistry()  # what only the HTTP side sees; the engine's own metrics come from it
    invalid_requests = Counter("specdec_invalid_requests", "Requests refused before any work, by status", ["status"],
                               registry=registry)
    # beside the engine's own (arrival in the engine to first token): the difference is this process's share
    # (tokenizing, the hops to the engine and back, making text)
    first_text = Histogram("specdec_server_time_to_first_token_seconds",
                           "A streamed request's arrival at its handler to its first text sent",
                           buckets=LATENCY_BUCKETS, registry=registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.bind_event_loop()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if api_key is not None:  # added last, so it runs first: a request without the key is not read
        app.add_middleware(ApiKeyCheck, key=api_key)

    def refuse(err: APIError) -> JSONResponse:
        invalid_requests.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return refuse(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError):
        return refuse(APIError(400, validation_message(err), param=validation_param(err)))

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse(error_body("the engine is not running", "internal_server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(await engine.metrics_text() + generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Empty the prefix cache of what no running request holds (benchmarks timing cold prompts again)."""
        try:
            return {"dropped_pages": await engine.reset_prefix_cache()}
        except (RuntimeError, asyncio.TimeoutError) as err:
            message = str(err) or "the engine did not answer"
            return JSONResponse(error_body(message, "internal_server_error"), status_code=503)

    card = {"id": model_name, "object": "model", "created": started, "owned_by": "specdec",
            "max_model_len": limits.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")  # a served name may hold slashes (a model directory's path)
    async def model(model: str):
        check_model(model)
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model if body.model is not None else model_name)
        chat = body.chat(model_name)
        if chat is not None:
            ids = await asyncio.to_thread(chat_prompt_ids, prompt_encoder, chat)
        else:
            [ids] = await asyncio.to_thread(completion_prompts, engine.tokenizer, body.prompt)
        return {"count": len(ids), "max_model_len": limits.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model if body.model is not None else model_name)
        problem = limits.why_not_tokens(body.tokens)
        if problem is not None:
            raise APIError(400, problem, param="tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}

    # tokenizing and chat templating run on worker threads: a long prompt never holds up the event loop
    # (other requests' streams, /health)
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrived = time.perf_counter()
        prompts = await asyncio.to_thread(completion_prompts, engine.tokenizer, body.prompt)
        prepared = [prepare(body, ids, body.max_tokens, f"prompt {i}: " if len(prompts) > 1 else "")
                    for i, ids in enumerate(prompts)]  # every prompt checked before any runs
        n = prepared[0][1].n
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} answers is over the {MAX_CHOICES} a request may ask "
                                "for; send the prompts in several requests", param="prompt")
        shape = ResponseShape(False, model_name, token_text(prepared[0][1]))
        if body.echo:  # each answer starts with its prompt (and its logprobs, when asked)
            texts = await asyncio.to_thread(lambda: [engine.tokenizer.decode(ids) for ids in prompts])
            shape.echo = {i * n + j: (text, ids) for i, (text, ids) in enumerate(zip(texts, prompts)) for j in range(n)}
        return await answer(request, body, shape, prepared, arrived)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrived = time.perf_counter()
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, prompt_encoder, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = prepare(body, prompt_ids, max_tokens)
        shape = ResponseShape(True, model_name, token_text(prepared[1]))
        if body.tool_dicts:  # the answer's tool calls are parsed out of its text
            shape.tool_texts = {}
        if reasoning_parser is not None:
            shape.reasoning_texts, shape.include_reasoning = {}, body.include_reasoning
            shape.starts_in_reasoning = starts_in_reasoning(engine.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        return await answer(request, body, shape, [prepared], arrived)

    def token_text(params: SamplingParams):
        """A token id's text for answers with logprobs (None when the request asked for none)."""
        if params.logprobs is None:
            return None
        return lambda token: engine.tokenizer.decode([token])

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found", kind="not_found_error")

    def prepare(body: GenerationFields, prompt_ids: list[int], max_tokens: int | None, which: str = ""):
        """Check everything up front; returns (prompt ids, sampling params). `which` heads the errors that concern
        the prompt (one of several: "prompt 2: ")."""
        check_model(body.model)
        unsupported = body.unsupported()
        if unsupported:
            raise APIError(400, f"not supported: {', '.join(unsupported)}")
        max_new = check_lengths(limits, len(prompt_ids), max_tokens, which)
        try:
            params = body.sampling_params(max_new, sampling_defaults)
        except ValueError as err:
            raise APIError(400, str(err)) from err
        problem = limits.why_invalid(prompt_ids, params.max_new_tokens, params.logit_bias, params.stop_token_ids)
        if problem is not None:
            raise APIError(400, which + problem)
        return prompt_ids, params

    async def answer(request: Request, body: GenerationFields, shape: ResponseShape,
                     prepared: list[tuple[list[int], SamplingParams]], arrived: float):
        """The answers to `prepared` (prompt ids, params) each: prompt i's answer j is choice i * n + j, as OpenAI's
        and vLLM's."""
        if not engine.healthy:
            raise APIError(503, "the engine is not running", kind="service_unavailable")
        # (choice index, output), n choices a prompt; submitted now: the engine starts while the response is set up
        outputs = await ChoiceOutputs.start([stream for prompt_ids, params in prepared
                                             for stream in engine.generate_samples(prompt_ids, params)])
        choices = Choices(len(prepared), prepared[0][1].n)
        if body.stream:
            first = lambda: first_text.observe(time.perf_counter() - arrived)  # noqa: E731
            return EventStream(stream_events(outputs, shape, body.include_usage, choices, first,
                                             body.continuous_usage), outputs)
        return await whole_answer(request, outputs, shape, choices)

    return app


def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    """The token ids of each prompt: a string, token ids, or a list of either (a batch, answered in order)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return [completion_prompt_ids(tokenizer, one, f"prompt {i}: " if len(prompt) > 1 else "")
                for i, one in enumerate(prompt)]
    return [completion_prompt_ids(tokenizer, prompt)]


def completion_prompt_ids(tokenizer, prompt: str | list[int], which: str = "") -> list[int]:
    """One prompt's token ids (`which` heads its errors)."""
    if isinstance(prompt, str):
        check_text(prompt, "prompt", which.rstrip(": ") or "prompt")
        return tokenizer.encode(prompt)
    try:
        return token_ids(prompt)
    except ValueError as err:
        raise APIError(400, which + str(err), param="prompt") from err


def chat_prompt_ids(encoder: PromptEncoder, body: ChatCompletionRequest) -> list[int]:
    conversation = body.conversation()
    for message in conversation:
        check_text(message["content"], "messages")
    try:
        return encode_chat(encoder, conversation, body.tool_dicts, **body.template_options())
    except APIError:
        raise
    except ChatOptionError as err:
        raise APIError(400, str(err), param=err.option) from err
    except Exception as err:  # noqa: BLE001 - a template that cannot render these messages: their fault
        raise APIError(400, f"the messages cannot be formatted with the model's chat template: {err}",
                       param="messages") from err


def check_text(text: str, param: str, label: str | None = None) -> None:
    """Text that cannot be encoded (a lone UTF-16 surrogate, which JSON's \\u escapes can carry) is refused; `label`
    names it in the error (default: `param`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{label or param} is not valid Unicode text: {err.reason} at character {err.start}",
                       param=param) from err


def check_lengths(limits: RequestLimits, prompt_len: int, max_tokens: int | None, which: str = "") -> int:
    """max_tokens checked against the context (the default: as many as the context and the KV pool allow); `which`
    heads the errors (one prompt of several)."""
    context = limits.max_context
    if prompt_len >= context:
        raise APIError(400, f"{which}this model's maximum context length is {context} tokens, but the prompt has "
                            f"{prompt_len}; shorten the prompt", param="messages", code="context_length_exceeded")
    if max_tokens is None:
        return max(1, limits.max_new_tokens_that_fit(prompt_len))
    if max_tokens < 1:
        raise APIError(400, f"{which}max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if prompt_len + max_tokens > context:
        raise APIError(400, f"{which}this model's maximum context length is {context} tokens, but "
                            f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, {max_tokens} for "
                            f"the completion); lower max_tokens to at most {context - prompt_len}", param="max_tokens",
                       code="context_length_exceeded")
    return max_tokens


class ChoiceOutputs:
    """The outputs of every choice's stream as (choice index, output) as they come. `start` starts the streams in
    order (the first submits the request the others share a prefill with) and returns once every request is
    submitted. `aclose` (safe before any read, and more than once) closes them all, which aborts what is still
    running."""

    def __init__(self, streams: list):
        self._streams = streams
        self._arrived: asyncio.Queue = asyncio.Queue()
        self._ended = 0
        self._tasks = [asyncio.ensure_future(self._pump(i, stream)) for i, stream in enumerate(streams)]

    @classmethod
    async def start(cls, streams: list) -> "ChoiceOutputs":
        outputs = cls(streams)
        try:
            # the tasks' first steps (each stream submitting its request) were queued first: they run before this
            # resumes, so the engine starts on the request while the caller is still building the response
            await asyncio.sleep(0)
        except BaseException:
            await outputs.aclose()
            raise
        return outputs

    async def _pump(self, index: int, stream) -> None:
        try:
            async for out in stream:
                self._arrived.put_nowait((index, out))
        finally:
            self._arrived.put_nowait((index, None))

    def __aiter__(self) -> "ChoiceOutputs":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._ended < len(self._streams):
            index, out = await self._arrived.get()
            if out is None:
                self._ended += 1
            else:
                return index, out
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()


class EventStream(StreamingResponse):
    """Server-sent events whose requests (`outputs`, submitted before the response began) are closed however the
    response ends: also when its events were never read (a client that left before streaming began)."""

    def __init__(self, events: AsyncIterator[str], outputs: ChoiceOutputs):
        super().__init__(events, media_type="text/event-stream")
        self.outputs = outputs

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.outputs.aclose()


@dataclass(frozen=True)
class Choices:
    """A request's answers: `n` to each of `prompts` prompts, prompt i's answer j being choice i * n + j."""

    prompts: int = 1
    n: int = 1

    def __len__(self) -> int:
        return self.prompts * self.n

    def usage(self, finals: list[RequestOutput]) -> dict:
        """Each prompt counted once, every answer's completion; the cache as each prompt's first answer found it."""
        firsts = finals[::self.n]
        return usage(sum(f.prompt_tokens for f in firsts), sum(f.completion_tokens for f in finals),
                     sum(f.cached_tokens for f in firsts))


async def stream_events(outputs, shape: ResponseShape, include_usage: bool, choices: Choices = Choices(),
                        on_first_text: Callable[[], None] | None = None, continuous_usage: bool = False):
    """Server-sent events: chunks as text comes (each with its choice's index, and with `continuous_usage` that
    choice's usage so far), each choice's finish reason, usage if asked, then [DONE]; `on_first_text` is called as
    the first chunk with text goes out. The response (`EventStream`) closes `outputs` when it ends, early or not."""
    for index in range(len(choices)):
        first = shape.first_chunk(index)
        if first is not None:
            yield sse(first)
    finals: dict[int, RequestOutput] = {}
    started: set[int] = set()
    async for index, out in outputs:
        if out.finished and out.finish_reason in ("error", "abort"):
            yield sse(error_body(out.error or "the request was aborted", "internal_server_error"))
            break
        text, logprobs = shape.echoed(out, index not in started, index)
        started.add(index)
        if text and on_first_text is not None:
            on_first_text()
            on_first_text = None
        if text or out.finished or logprobs:
            chunk = shape.chunk(text, out.finish_reason if out.finished else None, logprobs, index, out.stop_reason)
            if continuous_usage:
                chunk["usage"] = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            yield sse(chunk)
        if out.finished:
            finals[index] = out
    if len(finals) == len(choices) and include_usage:
        yield sse(shape.usage_chunk(choices.usage([finals[i] for i in range(len(choices))])))
    yield "data: [DONE]\n\n"


async def whole_answer(request: Request, outputs, shape: ResponseShape, choices: Choices = Choices()):
    """Collect every choice's whole text, unless the client disconnects first (then the requests are aborted)."""

    async def collect():
        count = len(choices)
        texts, logprobs, finals = [[] for _ in range(count)], [[] for _ in range(count)], [None] * count
        async for index, out in outputs:
            text, entries = shape.echoed(out, finals[index] is None, index)
            texts[index].append(text)
            logprobs[index] += entries or []
            finals[index] = out
        return ["".join(t) for t in texts], logprobs, finals

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            await asyncio.gather(collecting, return_exceptions=True)
        await outputs.aclose()  # what is still running is aborted
    if collecting.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    texts, logprobs, finals = collecting.result()
    failed = next((f for f in finals if f is None or f.finish_reason in ("error", "abort")), False)
    if failed is not False:
        reason = failed.finish_reason if failed is not None else "abort"
        return JSONResponse(error_body((failed.error if failed is not None else None) or "the request was aborted",
                                       "internal_server_error"), status_code=500 if reason == "error" else 503)
    asked = shape.token_text is not None
    return shape.whole([(text, final.finish_reason, lp if asked else None, final.stop_reason)
                        for text, final, lp in zip(texts, finals, logprobs)], choices.usage(finals))


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def validation_message(err: RequestValidationError) -> str:
    problems = []
    for e in err.errors()[:5]:
        where = ".".join(str(part) for part in e.get("loc", ()) if part != "body") or "body"
        problems.append("the body is not valid JSON" if e.get("type") == "json_invalid" else f"{where}: {e.get('msg')}")
    return "invalid request: " + "; ".join(problems)


def validation_param(err: RequestValidationError) -> str | None:
    errors = err.errors()
    loc = [str(part) for part in (errors[0].get("loc", ()) if errors else ()) if part != "body"]
    return loc[0] if loc else None

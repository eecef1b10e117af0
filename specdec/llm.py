"""The library API: `LLM(target, drafter).generate(prompts, params)`.

The composition root: the one module that knows every layer (weights, models, the engine and the
drafters) and puts them together."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from drafters import DEFAULT_DRAFTERS, load_drafter
from specdec.engine.config import EngineConfig
from specdec.engine.drafter import Drafter
from specdec.engine.engine import Engine
from specdec.engine.metrics import RequestStats, Summary, summarize
from specdec.engine.logprobs import TokenLogprob
from specdec.engine.prompt_encoder import PromptEncoder
from specdec.engine.prompts import Prompt, chat_template_text, encode_chat, prompt_list, token_ids
from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.text_stream import TextStream, final_text
from specdec.models.loader import load_target
from specdec.weights.demo_models import DEFAULT_TARGET, default_cache_dir, resolve_model
from specdec.weights.hub import check_revision


@dataclass
class GenerationResult:
    prompt: Prompt
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "stop" | "length" | "error" | "abort" (the call was interrupted)
    stats: RequestStats
    error: str | None = None
    # with SamplingParams.logprobs: the target's log-probability of each generated token and its alternatives
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: each prompt token's (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # finish reason "stop": the stop string or stop token id that ended it (None: end of sequence), as vLLM's
    stop_reason: str | int | None = None


class LLM:
    """A target model (and optionally a drafter) ready to generate.

    target: a demo model name (see `specdec.weights.demo_models.DEMO_MODELS`), an HF model directory,
    a .gguf file or a Hugging Face Hub id. drafter: "auto" (the default: the target's shipped drafter when it has one,
    as the command line does), None (plain decoding), a DFlash checkpoint directory or Hub id, a shipped drafter's
    name, or a `drafters.Drafter` instance. revision / drafter_revision: the branch, tag or commit of a Hub id (vLLM's
    --revision). chat_template: a chat template (a file or its Jinja text) used instead of the tokenizer's own. Other
    keyword arguments are `EngineConfig` fields.
    """

    def __init__(self, target: str | os.PathLike = DEFAULT_TARGET, drafter="auto", *,
                 device: str = "auto", dtype: str = "auto", kv_cache_dtype: str = "auto", page_size: int = 16,
                 chat_template: str | os.PathLike | None = None, revision: str | None = None,
                 drafter_revision: str | None = None, **engine_options):
        self.config = EngineConfig(device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, page_size=page_size,
                                   **engine_options)
        template = chat_template_text(chat_template) if chat_template is not None else None  # before loading
        if isinstance(drafter, str) and drafter == "auto":
            drafter = DEFAULT_DRAFTERS.get(os.fspath(target))
        # the target's revision is checked where its model is found (resolve_model, first thing); the drafter's here,
        # before the target loads
        if drafter_revision is not None and not isinstance(drafter, (str, os.PathLike)):
            raise ValueError(f"drafter_revision ({drafter_revision!r}) picks a version of a drafter given by Hugging "
                             f"Face Hub id, and the drafter here is {drafter!r}")
        if drafter_revision is not None:
            check_revision(os.fspath(drafter), drafter_revision)
        device_obj = self.config.torch_device()
        loaded = load_target(resolve_model(target, revision=revision), device_obj, self.config.torch_dtype(device_obj))
        loaded.cache_dir = default_cache_dir() / "calibration"
        self.target_name = os.fspath(target)
        self.drafter_name = None if drafter is None else type(drafter).__name__ if isinstance(drafter, Drafter) \
            else os.fspath(drafter)
        # a Drafter object (any implementation of specdec.engine.drafter.Drafter) is used as is
        draft_model = drafter if drafter is None or isinstance(drafter, Drafter) else load_drafter(
            drafter, loaded.model, drafter_revision)
        self.tokenizer = loaded.tokenizer
        if template is not None:
            if self.tokenizer is None:
                raise ValueError("a chat template needs the model's tokenizer, and this model has none")
            self.tokenizer.chat_template = template
        self.prompt_encoder = PromptEncoder(self.tokenizer)  # chat prompts' long pieces are tokenized once
        self.model_dir = loaded.path  # the HF directory the target was loaded from (converted, for a GGUF)
        self.engine = Engine(loaded, self.config, draft_model)
        self.last_summary: Summary | None = None
        self._lock = threading.Lock()
        self._generating: int | None = None  # the thread inside generate(), to catch re-entry from a callback

    def describe(self) -> str:
        """One line on what was loaded and how it runs (the command line and the server print it)."""
        engine = self.engine
        name = lambda dtype: str(dtype).removeprefix("torch.")  # noqa: E731
        kept = (f" (layers {', '.join(map(str, engine.full_precision_layers))} in {name(engine.dtype)})"
                if engine.full_precision_layers else "")
        drafter = (f", drafter {self.drafter_name} (block {engine.drafter.block_size}, verify {self.config.verify})"
                   if engine.drafter is not None else ", no drafter")
        graphs = (f"; CUDA graphs captured in {engine.graph_capture_seconds:.1f} s"
                  if engine.graph_capture_seconds is not None else "")
        pages = f"{engine.num_pages} pages of {engine.pool.page_size}"
        return (f"target {self.target_name} on {engine.device} ({name(engine.dtype)}, KV {name(engine.kv_dtype)}"
                f"{kept}, {engine.backend_name} attention, {pages}){drafter}{graphs}")

    def encode(self, prompt: Prompt, chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return token_ids(prompt)
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        """A conversation (and the `tools` the model may call: OpenAI's function definitions) through the chat
        template, as token ids for `generate`; `specdec.engine.tool_calls.split_calls(result.text)` reads the
        answer's calls, and `forced_calls(tools, name, parallel)` is the structured output that forces them.
        The options are vLLM's (`specdec.engine.prompts.encode_chat`)."""
        return encode_chat(self.prompt_encoder, messages, tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None, *,
                 chat: bool | None = None,
                 on_text: Callable[[int, str], None] | None = None,
                 on_finish: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (strings, or lists of token ids). `chat` overrides params.chat.

        on_text(index, new_text) is called as text is produced (streaming); on_finish(index, result)
        as soon as a request finishes (requests run concurrently, up to max_num_seqs at a time).

        Calls from several threads run one after another (a lock). If the call is interrupted or a
        component fails, the engine is left clean (every request of the call aborted, all pages
        returned) and the exception propagates with `partial_results`: a GenerationResult per prompt
        holding what it had committed (finish_reason "abort" where it had not finished)."""
        if self._generating == threading.get_ident():
            raise RuntimeError("LLM.generate was called from inside one of its own callbacks; collect the "
                               "prompts and call generate again after this call returns")
        with self._lock:
            self._generating = threading.get_ident()
            try:
                return self._generate(prompts, params, chat, on_text, on_finish)
            finally:
                self._generating = None

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None,
             on_text: Callable[[int, str], None] | None = None,
             on_finish: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Answer a conversation (a list of OpenAI-style messages) or a list of conversations, as vLLM's `LLM.chat`:
        each through the chat template (with `tools` and the options of `encode_chat`), then `generate`. A result's
        `prompt` is its conversation's token ids."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, (list, tuple)) or not conversations or not all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, dict) for m in c) for c in conversations):
            raise ValueError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                             "dicts) or a list of conversations")
        prompts = [self.encode_chat(list(c), tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, params, on_text=on_text, on_finish=on_finish)

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache of everything no request holds (between `generate` calls: all of it), so that the
        next prompts prefill whole, as on a fresh engine (e.g. to time cold prompts again). Returns how many pages of
        the target's KV it dropped; 0 with `enable_prefix_caching=False`."""
        if self._generating == threading.get_ident():
            raise RuntimeError("LLM.reset_prefix_cache was called from inside a generate callback; call it after "
                               "generate returns")
        with self._lock:
            return self.engine.reset_prefix_cache()

    def _generate(self, prompts, params, chat, on_text, on_finish) -> list[GenerationResult]:
        params = params or SamplingParams()
        chat = params.chat if chat is None else chat
        prompts = prompt_list(prompts)
        # n answers per prompt, consecutive: result i * n + j is prompt i's answer j
        requests = [r for p in prompts for r in self.engine.make_samples(self.encode(p, chat), params)]
        prompts = [p for p in prompts for _ in range(params.n)]
        if on_text is not None:
            for request in requests:
                request.use_detokenizer(self.tokenizer)
        on_commit = self._callbacks(prompts, requests, on_text, on_finish)
        if on_finish is not None:  # requests refused up front finish before any step
            for i, request in enumerate(requests):
                if request.finished:
                    on_finish(i, self._result(prompts[i], request))
        start = time.perf_counter()
        try:
            self.engine.run(requests, on_commit)
        except BaseException as err:  # Ctrl-C included: the engine has aborted what was left
            err.partial_results = [self._result(p, r) for p, r in zip(prompts, requests)]
            raise
        self.last_summary = summarize([r.stats for r in requests if r.finish_reason != "error"],
                                      time.perf_counter() - start)
        return [self._result(p, r) for p, r in zip(prompts, requests)]

    def _callbacks(self, prompts, requests: list[Request], on_text, on_finish):
        if on_text is None and on_finish is None:
            return None
        index = {r.request_id: i for i, r in enumerate(requests)}
        streams = {r.request_id: TextStream(r) for r in requests} if on_text is not None else {}

        def on_commit(request: Request, tokens: list[int]) -> None:
            i = index[request.request_id]
            result = self._result(prompts[i], request) if request.finished else None
            if on_text is not None:
                text = streams[request.request_id].take(result.text if result is not None else None)
                if text:
                    on_text(i, text)
            if on_finish is not None and result is not None:
                on_finish(i, result)

        return on_commit

    def _result(self, prompt: Prompt, request: Request) -> GenerationResult:
        return GenerationResult(prompt, request.prompt_ids, list(request.output_ids),
                                final_text(self.tokenizer, request), request.finish_reason, request.stats, request.error,
                                request.output_logprobs, request.prompt_logprobs, request.stop_reason)

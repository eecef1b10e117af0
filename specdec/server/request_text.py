"""One served request's text, made on the server's side of the engine: detokenization, stop strings and
streaming pieces.

The engine loop ships token ids only (text work per request and step would take the engine's host
time); the engine runs a request without its stop strings. Here a mirror `Request` commits the same
tokens with the stop strings, so a stop ends it exactly where the library would end it (same text,
same token count, finish reason "stop"); the caller then aborts the engine's request, whose few
tokens generated past the stop are dropped. The mirror knows the engine's ending ids (end of sequence,
stop token ids) too: the engine ends at the same token, and the text and stop reason come out as the library's.

    text = RequestText(prompt_ids, params, tokenizer, eos_token_ids)
    out = text.update(engine_output)     # the client's output: new text, tokens up to a stop, state
    text.stopped_early                   # a stop string ended it before the engine did: abort there
"""

from __future__ import annotations

from dataclasses import replace

from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.text_stream import TextStream, final_text
from specdec.server.engine_loop import RequestOutput


def engine_params(params: SamplingParams) -> SamplingParams:
    """What the engine runs: the same request without stop strings (matched here)."""
    return replace(params, stop=None) if params.stop else params


class RequestText:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        # the mirror ends at an ending id or at max_new_tokens at the same token as the engine does
        self.mirror = Request(-1, list(prompt_ids), params, eos_token_ids)
        self.mirror.use_detokenizer(tokenizer)
        self.stream = TextStream(self.mirror)
        self.stopped_early = False

    def update(self, out: RequestOutput) -> RequestOutput:
        """The client's view of the engine's output `out` (tokens only)."""
        mirror = self.mirror
        try:
            taken = mirror.commit_many(out.token_ids, out.logprobs)
        except Exception as err:  # noqa: BLE001 - this request fails alone, as it would in the engine
            mirror.finish("error", f"detokenizing failed: {type(err).__name__}: {err}")
            taken = 0
        tokens = out.token_ids[:taken]
        logprobs = out.logprobs[:taken] if out.logprobs is not None else None
        if mirror.finished and not out.finished:  # a stop string (or a failure) ended it first
            self.stopped_early = True
        elif out.finished and not mirror.finished:
            mirror.finish(out.finish_reason, out.error)
        if not mirror.finished:
            return RequestOutput(self.stream.take(), tokens, prompt_tokens=out.prompt_tokens,
                                 completion_tokens=len(mirror.output_ids), cached_tokens=out.cached_tokens,
                                 logprobs=logprobs, prompt_logprobs=out.prompt_logprobs)
        return RequestOutput(self.stream.take(final_text(self.tokenizer, mirror)), tokens, True, mirror.finish_reason,
                             mirror.error, out.prompt_tokens, len(mirror.output_ids), out.cached_tokens, logprobs,
                             out.prompt_logprobs, mirror.stop_reason)

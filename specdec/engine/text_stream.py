"""A request's text as it is produced, for streaming: the library's `on_text` and the server's deltas.

The pieces a `TextStream` hands out add up to `final_text(...)`, the request's whole text: special
tokens removed (unless the request keeps them) and cut where a stop string matched (before it, or after it with
include_stop_str_in_output). Text that could still become a stop string is
held back until it cannot, so text past a stop is never shown.
"""

from __future__ import annotations

from specdec.engine.request import Request


def final_text(tokenizer, request: Request) -> str:
    """The request's output as text: special tokens removed (unless kept), cut at a matched stop string, and
    without the ending id that ended it (end of sequence, a stop token id) unless the request includes it, as
    vLLM's text leaves it out."""
    ids = request.output_ids
    if request.ended_by_token and not request.params.include_stop_str_in_output:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=request.params.skip_special_tokens)
    return text if request.stop_text_end is None else text[:request.stop_text_end]


class TextStream:
    """New text of one request's detokenizer (`Request.use_detokenizer` first), less a tail that could
    still become a stop string, then at the end the rest of the final text."""

    def __init__(self, request: Request):
        self.request = request
        self.shown = 0  # characters handed out
        self.held = ""  # text read from the detokenizer but not handed out yet
        self.hold = max(map(len, request.params.stop or ()), default=1) - 1

    def take(self, final: str | None = None) -> str:
        """The text to show now; pass the request's `final_text` once it has finished."""
        if final is not None:
            # the final text is a full decode: it also has what the detokenizer still held back
            text = final[self.shown:]
        else:
            pending = self.held + self.request.detokenizer.read()
            cut = max(0, len(pending) - self.hold)
            text, self.held = pending[:cut], pending[cut:]
        self.shown += len(text)
        return text

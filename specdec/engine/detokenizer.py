"""Committed token ids -> text, incrementally: each token costs a bounded amount of decoding, so a
whole output is detokenized in time linear in its length (decoding everything again at each token
would be quadratic).

    detok = IncrementalDetokenizer(tokenizer)
    for token in output_ids:
        new_text = detok.push(token)  # text that no later token can change; often "" mid-character
    rest = detok.flush()              # at the end: what was held back (an incomplete character)

Two ways to step, same result:
- `tokenizers.decoders.DecodeStream` on the fast tokenizer's Rust backend, when the tokenizer's own
  `decode` is exactly the backend's (`_stream_backend`);
- otherwise the prefix/read-offset window over `tokenizer.decode`: decode the last few tokens with
  and without the new ones and emit the difference, holding back a trailing U+FFFD until the next
  token completes the character. The decode stream falls back to this when it raises or stalls.

The concatenated text equals `tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)` for any
valid UTF-8 output. One known difference, inherent to incremental decoding: a byte-fallback tokenizer (Llama-2
style `<0xNN>` tokens, `ByteFallback` decoder) turns a *whole run* of byte tokens into U+FFFDs when
the run is not valid UTF-8, so a byte that was already emitted as text can turn into U+FFFD in the
full decode once an invalid byte follows. Callers that need the exact full decode (a request's final
text) decode all tokens once at the end.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Tokens held back without emitting (an incomplete character, or tokens that decode to nothing such
# as skipped special tokens). No valid UTF-8 character spans more bytes than 4, so past this many
# tokens the text will not change any more: emit it as it is so that the window stays bounded.
MAX_PENDING = 8

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # a tokenizers without DecodeStream, or none: the window method only
    _RustTokenizer = DecodeStream = None


def _stream_backend(tokenizer):
    """The `tokenizers.Tokenizer` whose decode stream reproduces `tokenizer.decode`, or None."""
    if DecodeStream is None:
        return None
    if isinstance(tokenizer, _RustTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, _RustTokenizer):
        return None  # a slow (pure Python) tokenizer
    # transformers may post-process the backend's text: cleanup of spaces before punctuation, or a
    # model-specific decode override. Either would make the stream's text differ from tokenizer.decode.
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.read_offset = 0  # ids[:read_offset] are emitted
        # the tokens of the last emission that made text, decoded again in front of the new ones:
        # a token's text can depend on what precedes it (leading-space stripping, merged bytes)
        self.context: list[int] = []
        self.num_chars = 0  # characters emitted so far
        # emitted text not yet taken by `read` (streaming); unstreamed, it grows like the token list
        self._unread: list[str] = []
        self._backend = _stream_backend(tokenizer)
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None
                        else None)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    def push(self, token_id: int) -> str:
        """Add one committed token; returns the text it made stable (possibly "")."""
        self.ids.append(token_id)
        text = self._stream_step(token_id) if self._stream is not None else self._window_step()
        return self._emit(text)

    def flush(self) -> str:
        """The text still held back (a trailing incomplete character shows as U+FFFD, as in a full decode)."""
        return self._emit(self._window_step(force=True)) if self.read_offset < len(self.ids) else ""

    def read(self) -> str:
        """All text emitted since the previous `read` (the streaming view of the same text)."""
        text = "".join(self._unread)
        self._unread.clear()
        return text

    def _emit(self, text: str) -> str:
        if text:
            self.num_chars += len(text)
            self._unread.append(text)
        return text

    def _advance(self, made_text: bool) -> None:
        # everything so far is emitted; tokens that made no text (skipped special tokens) would be
        # no context for the next ones, so the previous context stays then
        if made_text:
            self.context = self.ids[self.read_offset:]
        self.read_offset = len(self.ids)

    def _stream_step(self, token_id: int) -> str:
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers raises when the new decode does not extend the previous one
            self._stream = None
            return self._window_step()
        if text is not None:
            self._advance(made_text=True)
            return text
        if len(self.ids) - self.read_offset > MAX_PENDING:
            # the stream re-decodes every token since its last output at each step: a long run of
            # skipped special tokens would make that quadratic, so the bounded window takes over
            self._stream = None
            return self._window_step()
        return ""

    def _window_step(self, force: bool = False) -> str:
        prefix = self._decode(self.context)
        text = self._decode(self.context + self.ids[self.read_offset:])
        force = force or len(self.ids) - self.read_offset >= MAX_PENDING
        if not force and (len(text) <= len(prefix) or text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or the last character is still incomplete
        self._advance(made_text=len(text) > len(prefix))
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

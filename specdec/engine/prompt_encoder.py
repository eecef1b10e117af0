"""Text into token ids, with the ids of long pieces remembered: what a server meets again and again (a shared
system prompt, the earlier turns of a conversation) is tokenized once.

A tokenizer splits its input at its added tokens (`<|im_start|>`, `<|im_end|>`, ...) before anything else and
tokenizes the pieces between them one by one, so a text's ids are its pieces' ids and its added tokens' ids in
order (with one exception, refused here: a pre-tokenizer that treats the text's first piece apart, as
SentencePiece-style Metaspace with prepend_scheme "first" does). A `PromptEncoder` splits the same way, keeps
the ids of pieces of at least `min_chars` characters (default 256; least recently used first out, at most `max_chars`
characters kept), and hands everything between them to the tokenizer as it is. Where the tokenizer's added
tokens split otherwise (they strip the whitespace beside them, match whole words only, or match after a
normalizer), it always encodes the whole text; and the first text it splits is checked against the whole text's
ids once (a difference turns the splitting off for good).

    encoder = PromptEncoder(tokenizer)
    ids = encoder.encode(text)       # == tokenizer.encode(text, add_special_tokens=False)
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

log = logging.getLogger(__name__)


class PromptEncoder:
    # min_chars: an answer of ~64 tokens and up is remembered, so each turn of a conversation tokenizes little more
    # than what it adds (at 1024, the 5th turn of a chat took twice as long to encode; 64-128 gained nothing on 256)
    def __init__(self, tokenizer, min_chars: int = 256, max_chars: int = 8_000_000):
        self.tokenizer = tokenizer
        self.min_chars, self.max_chars = min_chars, max_chars
        self.splitter = added_token_splitter(tokenizer)  # None: the whole text goes to the tokenizer
        self.hits = 0  # pieces whose ids were remembered
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        self._checked = False
        self._lock = threading.Lock()  # the server tokenizes on worker threads

    def encode(self, text: str) -> list[int]:
        """`text`'s token ids, without the tokenizer's own special tokens (BOS): the ids of
        `tokenizer.encode(text, add_special_tokens=False)`."""
        if self.splitter is None or len(text) < self.min_chars:
            return self._encode(text)
        pieces = self.splitter.split(text)  # text, added token, text, ..., text
        if not any(len(piece) >= self.min_chars for piece in pieces[::2]):
            return self._encode(text)
        ids, run = [], []  # run: the text since the last long piece, encoded in one call
        for index, piece in enumerate(pieces):
            if index % 2 == 0 and len(piece) >= self.min_chars:
                if run:
                    ids += self._encode("".join(run))
                    run = []
                ids += self._piece_ids(piece)
            else:
                run.append(piece)
        if run:
            ids += self._encode("".join(run))
        if not self._checked:
            self._checked = True
            if ids != self._encode(text):
                log.warning("this tokenizer does not split text at its added tokens as expected; prompts are "
                            "tokenized whole")
                self.splitter = None
                return self._encode(text)
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _piece_ids(self, piece: str) -> list[int]:
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
                self.hits += 1
                return ids
        ids = self._encode(piece)
        if len(piece) <= self.max_chars:
            with self._lock:
                if piece not in self._ids:
                    self._ids[piece] = ids
                    self._chars += len(piece)
                while self._chars > self.max_chars:
                    old, _ = self._ids.popitem(last=False)
                    self._chars -= len(old)
        return ids


def added_token_splitter(tokenizer) -> re.Pattern | None:
    """A pattern whose `split` cuts text at the tokenizer's added tokens as the tokenizer does (leftmost, longest
    first), keeping them; None where the tokenizer would split otherwise or is not a fast tokenizer."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not added or backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    if any(_treats_first_piece_apart(json.loads(component.__getstate__())) for component in _pipeline_steps(backend)):
        return None
    has_normalizer = backend.normalizer is not None
    for token in added.values():
        if token.lstrip or token.rstrip or token.single_word or (token.normalized and has_normalizer):
            return None
    contents = sorted({token.content for token in added.values() if token.content}, key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, contents)) + ")")


def _pipeline_steps(backend) -> list:
    """The tokenizer's normalizer, pre-tokenizer, post-processor and decoder, those it has: its pipeline without the
    model, whose vocabulary and merges (hundreds of thousands of entries) serializing the whole tokenizer would walk."""
    return [step for step in (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder)
            if step is not None]


def _treats_first_piece_apart(spec) -> bool:
    """Whether a tokenizer's serialized pipeline has a step that depends on a piece being the text's first."""
    if isinstance(spec, dict):
        return spec.get("prepend_scheme") == "first" or any(map(_treats_first_piece_apart, spec.values()))
    if isinstance(spec, list):
        return any(map(_treats_first_piece_apart, spec))
    return False

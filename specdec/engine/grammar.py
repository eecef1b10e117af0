"""Grammar matchers of requests with structured output, and the masks they put on the target's logits.

Each such request holds an llguidance matcher that its committed tokens advance (`Request.commit`). A step
masks the request's rows with what its grammar allows there. Row j of a verified block follows the committed
tokens and the first j drafts, so its mask is the matcher's after those drafts: llguidance advances along
them, writes each row's mask and rolls back. A draft the grammar refuses ends that walk: its row's target
token is drawn from the masked row, so it differs from the draft and no later row can be accepted (those
rows stay unmasked). Greedy constrained speculative output therefore equals greedy constrained plain output.

    grammars = Grammars(tokenizer, vocab_size, eos_token_ids)   # once per engine, on the first such request
    request.matcher = grammars.matcher(params.structured_output)
    bits = bitmask(requests, rows_per_request, drafts)           # host int32 [B * rows, words], rows in order
    logits = masked(logits, upload(bits))                         # disallowed tokens -> -inf

Masks are computed on the host (llguidance's thread pool) while the GPU runs the step's forward.
"""

from __future__ import annotations

import functools
import json

import llguidance
import numpy as np
import torch

from specdec.engine.structured_output import StructuredOutput


class Grammars:
    """The tokenizer as llguidance sees it (built once: about a second for a 150k vocabulary), over the model's
    whole vocabulary (ids past the tokenizer's are never allowed), with the model's end-of-sequence tokens
    (allowed where the grammar may end)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer = llguidance_tokenizer(tokenizer, vocab_size, sorted(eos_token_ids))
        self.vocab_size = vocab_size

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {matcher.get_error()}")
        return matcher


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast (Rust) tokenizer, checked token by token against the tokenizer's own
    decoding: a grammar can only be enforced over the bytes each token really stands for."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs the model's fast (tokenizers) tokenizer; this model has "
                         f"{type(tokenizer).__name__ if tokenizer is not None else 'none'}")
    spec = json.loads(backend.to_str())
    spec["padding"] = spec["truncation"] = None
    if _byte_level(spec.get("pre_tokenizer")) and spec.get("decoder", {}).get("type") != "ByteLevel":
        # byte-level vocabularies whose decoder is wrapped in sentencepiece-style steps (transformers' GGUF
        # conversion writes ByteFallback, Fuse, Replace, then ByteLevel): llguidance would read such tokens as
        # text ("Ċ" the letter, not a newline) and let a raw newline into a JSON string
        spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        spec["model"]["byte_fallback"] = False
    llg = llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=eos_token_ids or None)
    wrong = _misread_tokens(tokenizer, llg)
    if wrong:
        shown = ", ".join(f"{i} ({tokenizer.decode([i])!r} read as {llg.decode_str([i])!r})" for i in wrong[:3])
        raise ValueError(f"structured output cannot be enforced for this model: llguidance reads {len(wrong)} of its "
                         f"tokens as other text than its tokenizer decodes them to, e.g. {shown}")
    return llg


def _byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    return pre_tokenizer.get("type") == "ByteLevel" or any(_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))


def _misread_tokens(tokenizer, llg: llguidance.LLTokenizer) -> list[int]:
    """Ordinary tokens whose text differs between the tokenizer and llguidance (added and special tokens, and
    pieces of a multi-byte character, which decode alone to a replacement character, are not compared; a leading
    space is, since sentencepiece decoders drop it from a first token)."""
    added = set(getattr(tokenizer, "added_tokens_decoder", {}))
    ids = [i for i in range(len(tokenizer)) if i not in added]
    texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    return [i for i, text in zip(ids, texts) if "\ufffd" not in text
            and llg.decode_bytes([i]).decode("utf-8", "replace").lstrip(" ") != text.lstrip(" ")]


@functools.lru_cache(maxsize=1)
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()


def bitmask(requests: list, rows_per_request: int, drafts: list[list[int]] | None, vocab_size: int) -> np.ndarray:
    """Allowed tokens of `rows_per_request` rows per request, one bit per token ([B * rows, ceil(vocab / 32)]
    int32; request i's rows first to last). Row j follows drafts[i][:j] (None: one row each). Rows of requests
    without a matcher allow everything."""
    words = (vocab_size + 31) // 32
    bits = np.full((len(requests) * rows_per_request, words), -1, dtype=np.int32)  # all allowed
    rows = [(r.matcher, i * rows_per_request, list(drafts[i][:rows_per_request - 1]) if drafts is not None else [])
            for i, r in enumerate(requests) if r.matcher is not None]
    walks, single = [w for w in rows if w[2]], [w[:2] for w in rows if not w[2]]  # llguidance refuses empty walks
    if walks:
        _executor().unsafe_compute_mask_ptr_with_draft_token(walks, bits.ctypes.data, words * 4, bits.shape[0])
    if single:
        _executor().unsafe_compute_mask_ptr(single, bits.ctypes.data, words * 4, bits.shape[0])
    return bits


def masked(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """`logits` [n, vocab] with every token `bits` [n, words] (int32, on the device) does not allow at -inf.
    Unpacked a byte at a time (bit j of byte b is token 8b + j, the words being little-endian): one byte per
    token, not four."""
    shifts = torch.arange(8, device=logits.device, dtype=torch.uint8)
    allowed = ((bits.view(torch.uint8)[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))

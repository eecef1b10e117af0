"""PromptEncoder gives exactly the tokenizer's ids for any text, remembering the ids of long pieces between
added tokens; where a tokenizer's added tokens split text otherwise, it encodes texts whole."""

import re

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec.engine.prompt_encoder import PromptEncoder
from tests.tokenizer_helpers import CORPUS, LONG_TOKEN, as_transformers, bytelevel_tokenizer, gguf_style

MIN_CHARS = 24
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", LONG_TOKEN, "system\n", "user\n", " ", "\n", "  ",
             "Hello world", "quick brown fox", "naïve café", "Zürich straße", "1234", "x" * 30,
             "The quick brown fox jumps over the lazy dog. " * 2, "<|im", "end|>", "\t", "🙂"]
texts = st.lists(st.sampled_from(FRAGMENTS), max_size=30).map("".join)


def tokenizers():
    return {"bytelevel": as_transformers(bytelevel_tokenizer()),
            "gguf-style": as_transformers(gguf_style(bytelevel_tokenizer()))}


TOKENIZERS = tokenizers()


@settings(max_examples=300, deadline=None)
@given(st.lists(texts, min_size=1, max_size=4), st.sampled_from(sorted(TOKENIZERS)))
def test_ids_equal_the_tokenizers(batch, name):
    tokenizer = TOKENIZERS[name]
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS)
    assert encoder.splitter is not None
    for text in batch + batch:  # the second time round, long pieces come from what it remembered
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_a_shared_long_piece_is_tokenized_once():
    tokenizer = TOKENIZERS["bytelevel"]
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS)
    system = "You are a careful assistant. Answer briefly. " * 20
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, **kw: calls.append(text) or encode(text, **kw)
    try:
        for question in ("Hello world", "quick brown fox", "naïve café"):
            text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            assert encoder.encode(text) == encode(text, add_special_tokens=False)
    finally:
        del tokenizer.encode
    assert encoder.hits == 2
    assert sum(system in text for text in calls) == 2  # the first time, and the one check of a split text


def test_the_memory_stays_within_max_chars():
    tokenizer = TOKENIZERS["bytelevel"]
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS, max_chars=100)
    for n in range(10):
        text = f"<|im_start|>{'Hello world ' * 5}{n}<|im_end|>"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert encoder._chars <= 100 and len(encoder._ids) == 1


def test_added_tokens_that_strip_whitespace_turn_splitting_off():
    tok = bytelevel_tokenizer()
    tok.add_special_tokens([AddedToken("<tool>", lstrip=True)])
    tokenizer = as_transformers(tok)
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS)
    assert encoder.splitter is None
    text = "Hello world " * 5 + "  <tool>" + "quick brown fox " * 5
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("nested", [False, True], ids=["alone", "in-a-sequence"])
def test_a_pre_tokenizer_that_treats_the_first_piece_apart_turns_splitting_off(nested):
    """Metaspace with prepend_scheme "first" (Llama 2 / Mistral style) marks only the text's first piece: a piece
    encoded alone is marked where the whole text's is not, so such tokenizers encode texts whole."""
    tok = Tokenizer(models.BPE())
    metaspace = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), metaspace]) if nested else metaspace
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        show_progress=False))
    tokenizer = as_transformers(tok)
    text = "<|im_start|>" + "Hello world " * 5
    whole = tokenizer.encode(text, add_special_tokens=False)
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS)
    assert encoder.splitter is None and encoder.encode(text) == whole
    encoder.splitter, encoder._checked = re.compile("(<\\|im_start\\|>)"), True  # splitting anyway would be wrong
    assert encoder.encode(text) != whole


def test_a_tokenizer_that_splits_otherwise_is_caught_by_the_first_check():
    tokenizer = TOKENIZERS["bytelevel"]
    encoder = PromptEncoder(tokenizer, min_chars=MIN_CHARS)
    encoder.splitter = re.compile("( )")  # splits where the tokenizer does not: a space joins the word after it
    text = "a" * MIN_CHARS + " " + "b" * MIN_CHARS
    assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert encoder.splitter is None

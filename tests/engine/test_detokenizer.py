"""Incremental detokenization: its text equals a full decode, stop strings are found anywhere in the
new text (also inside one long token), streamed pieces add up to the final text, and the work per
committed token stays bounded."""

from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from specdec.engine.detokenizer import MAX_PENDING, IncrementalDetokenizer
from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.text_stream import final_text
from tests.tokenizer_helpers import CORPUS, LONG_TOKEN, as_transformers, bytelevel_tokenizer

TEXTS = ["Hi 😀 there 你好世界, naïve café — ok\n\n" + " " * 80 + "end",
         "The quick brown fox 🦊🦊 jumps over the lazy dog.",
         "  leading spaces\tand tabs\n", "日本語のテキスト", "a😀b👨‍👩‍👧c ends with emoji 🎉"]


# ---- more tokenizers built here (no downloads) --------------------------------------------------
def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2 style: '▁' for spaces, <0xNN> byte tokens, a decoder that strips the leading space."""
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = norm
    trained.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                            show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return tok


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece style without byte fallback: Metaspace pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    return tok


class DecodeOnly:
    """A tokenizer with nothing but `decode` (as a slow tokenizer looks): takes the window path.
    Counts the tokens it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens_decoded = 0

    def decode(self, ids, skip_special_tokens=False):
        self.tokens_decoded += len(ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if os.environ.get("SPECDEC_SKIP_DOWNLOAD_TESTS") == "1":
        pytest.skip("downloads disabled")
    from transformers import AutoTokenizer

    from specdec.weights.demo_models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))


TOKENIZERS = {"bytelevel": lambda: as_transformers(bytelevel_tokenizer()),
              "byte_fallback": lambda: as_transformers(byte_fallback_tokenizer()),
              "metaspace": lambda: as_transformers(metaspace_tokenizer())}


@pytest.fixture(scope="module", params=[*TOKENIZERS, "smollm2"])
def tokenizer(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_tokenizer")
    return TOKENIZERS[request.param]()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def detokenize(tokenizer, ids, skip_special_tokens=True) -> tuple[list[str], IncrementalDetokenizer]:
    """The text emitted at each token, then the flushed rest."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    pieces = [detok.push(t) for t in ids]
    return pieces + [detok.flush()], detok


def outputs(tokenizer, seed=0) -> list[list[int]]:
    """Encoded texts, and the same with special tokens (skipped when decoding) put in at random."""
    rng = random.Random(seed)
    specials = [i for i, added in tokenizer.added_tokens_decoder.items() if added.special]
    cases = []
    for text in TEXTS:
        ids = encode(tokenizer, text)
        cases.append(ids)
        for _ in range(5):
            with_specials = list(ids)
            for _ in range(rng.randrange(1, 4)):
                with_specials.insert(rng.randrange(len(with_specials) + 1), rng.choice(specials))
            cases.append(with_specials)
    return cases


# ---- the detokenizer on its own -----------------------------------------------------------------
@pytest.mark.parametrize("window_path", [False, True], ids=["decode_stream", "window"])
def test_incremental_text_equals_full_decode(tokenizer, window_path):
    tok = DecodeOnly(tokenizer) if window_path else tokenizer
    assert IncrementalDetokenizer(tok).uses_decode_stream is not window_path
    split_characters = 0
    for ids in outputs(tokenizer):
        pieces, detok = detokenize(tok, ids)
        full = full_decode(tokenizer, ids)
        assert "".join(pieces) == full
        assert detok.num_chars == len(full)
        # every piece is final: no replacement character from a half-received character
        assert "\ufffd" not in "".join(pieces)
        split_characters += pieces[:-1].count("")
    assert split_characters > 0  # multi-byte characters really were split across tokens


@pytest.mark.parametrize("window_path", [False, True], ids=["decode_stream", "window"])
def test_special_tokens_kept_when_asked(tokenizer, window_path):
    """skip_special_tokens=False (vLLM's): the special tokens' text stays, and still equals a full decode. (Where a
    special token splits a multi-byte character, the output is not valid UTF-8: the module doc's known case.)"""
    tok = DecodeOnly(tokenizer) if window_path else tokenizer
    kept = 0
    for ids in outputs(tokenizer):
        full = full_decode(tokenizer, ids, skip_special_tokens=False)
        if "\ufffd" in full:
            continue
        pieces, detok = detokenize(tok, ids, skip_special_tokens=False)
        assert "".join(pieces) == full and detok.num_chars == len(full)
        kept += len(full) > len(full_decode(tokenizer, ids))
    assert kept > 0  # some outputs had special tokens, and their text stayed


@pytest.mark.parametrize("name", ["bytelevel", "metaspace", "smollm2"])
@pytest.mark.parametrize("window_path", [False, True], ids=["decode_stream", "window"])
def test_random_token_ids_equal_full_decode(name, window_path, request):
    """Random ids: invalid UTF-8 mid-text and at the end, runs of special tokens. (Not for byte-fallback
    tokenizers: there an invalid byte turns earlier bytes of its run into U+FFFD, see the module doc.)"""
    tokenizer = request.getfixturevalue("smollm2_tokenizer") if name == "smollm2" else TOKENIZERS[name]()
    rng = random.Random(1)
    tok = DecodeOnly(tokenizer) if window_path else tokenizer
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        assert "".join(detokenize(tok, ids)[0]) == full_decode(tokenizer, ids)


def test_decode_stream_is_used_only_where_it_reproduces_decode():
    fast = as_transformers(bytelevel_tokenizer())
    assert IncrementalDetokenizer(fast).uses_decode_stream
    assert IncrementalDetokenizer(bytelevel_tokenizer()).uses_decode_stream  # a bare tokenizers.Tokenizer
    assert not IncrementalDetokenizer(DecodeOnly(fast)).uses_decode_stream
    # transformers' space cleanup changes the backend's text: the window over tokenizer.decode is used
    cleanup = as_transformers(metaspace_tokenizer(), clean_up_tokenization_spaces=True)
    assert not IncrementalDetokenizer(cleanup).uses_decode_stream
    for ids in outputs(cleanup) + [encode(cleanup, "Hello , world . Stop !")]:
        assert "".join(detokenize(cleanup, ids)[0]) == full_decode(cleanup, ids)


def test_skipped_special_tokens_keep_the_window_bounded():
    """A long run of skipped special tokens: the decode stream would re-decode the whole run at
    every token; the detokenizer hands over to the bounded window instead, and loses no text."""
    tokenizer = as_transformers(byte_fallback_tokenizer())
    special = tokenizer.convert_tokens_to_ids("</s>")
    hello_world = encode(tokenizer, "Hello world")
    ids = hello_world[:1] + [special] * 200 + hello_world[1:]
    detok = IncrementalDetokenizer(tokenizer)
    for t in ids:
        detok.push(t)
        assert len(detok.ids) - detok.read_offset <= MAX_PENDING
        assert len(detok.context) <= MAX_PENDING + 1
    assert not detok.uses_decode_stream
    assert detok.read() + detok.flush() == full_decode(tokenizer, ids) == "Hello world"


@pytest.mark.parametrize("n", [300, 3000])
def test_work_per_token_is_bounded(n):
    """Tokens decoded per commit stay under a constant, whatever the length of the output so far."""
    tokenizer = DecodeOnly(as_transformers(bytelevel_tokenizer()))
    text = " ".join(TEXTS)
    ids = (encode(tokenizer.tokenizer, text) * (n // 20 + 1))[:n]
    request = make_request(tokenizer, stop=["<never>", "\n\n\n\n"])
    per_commit = []
    for t in ids:
        before = tokenizer.tokens_decoded
        assert not request.commit(t)
        per_commit.append(tokenizer.tokens_decoded - before)
    assert max(per_commit) <= 4 * (MAX_PENDING + 1)
    assert sum(per_commit) <= 8 * n
    assert len(request.stop_tail) <= len("<never>") - 1


# ---- stop strings -------------------------------------------------------------------------------
def make_request(tokenizer, stop, max_new_tokens=100_000, **params) -> Request:
    request = Request(0, [1], SamplingParams(max_new_tokens=max_new_tokens, stop=stop, **params), frozenset())
    request.use_detokenizer(tokenizer)
    return request


def first_stop(tokenizer, ids, stops) -> tuple[int, int] | None:
    """Reference: the first k whose text decode(ids[:k]) holds a stop, and where the earliest one starts.
    Text ending in a half-received character is not final yet: it is seen once the character is complete."""
    for k in range(1, len(ids) + 1):
        text = full_decode(tokenizer, ids[:k])
        if text.endswith("\ufffd"):
            continue
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return k, min(hits)
    return None


@pytest.mark.parametrize("name", ["bytelevel", "smollm2"])
def test_stop_string_inside_one_long_token(name, request):
    tokenizer = request.getfixturevalue("smollm2_tokenizer") if name == "smollm2" else TOKENIZERS[name]()
    assert len(encode(tokenizer, LONG_TOKEN)) == 1
    ids = encode(tokenizer, "Answer:") + encode(tokenizer, LONG_TOKEN) + encode(tokenizer, "more")
    request = make_request(tokenizer, stop=["\n"])
    taken = request.commit_many(ids)
    assert request.finish_reason == "stop"
    assert (taken, request.stop_text_end) == first_stop(tokenizer, ids, ["\n"])
    assert request.stop_text_end == len("Answer:")


def test_smollm2_81_character_token_fires_stop(smollm2_tokenizer):
    long_id = smollm2_tokenizer.convert_tokens_to_ids("Ċ" + "Ġ" * 80)
    assert smollm2_tokenizer.decode([long_id]) == LONG_TOKEN
    ids = encode(smollm2_tokenizer, "def f():") + [long_id] + encode(smollm2_tokenizer, "return 1")
    request = make_request(smollm2_tokenizer, stop=["\n"])
    assert request.commit_many(ids) == len(ids) - len(encode(smollm2_tokenizer, "return 1"))
    assert request.finish_reason == "stop" and request.stop_text_end == len("def f():")


def test_stop_strings_match_a_full_decode_reference(tokenizer):
    """Wherever a stop ends up (across tokens, several stops, overlapping ones), the request stops at
    the first token whose text holds one, and stop_text_end is where the earliest match starts."""
    rng = random.Random(2)
    for ids in outputs(tokenizer):
        text = full_decode(tokenizer, ids)
        for _ in range(4 if text else 0):  # (text is empty where a tokenizer has only <unk> for it)
            stops = []
            for _ in range(rng.randrange(1, 3)):
                start = rng.randrange(len(text))
                stops.append(text[start:start + rng.randrange(1, 8)])
            request = make_request(tokenizer, stop=stops)
            taken = request.commit_many(ids)
            assert request.finish_reason == "stop"
            assert (taken, request.stop_text_end) == first_stop(tokenizer, ids, stops), stops


def test_a_stop_string_is_kept_at_the_end_when_asked(tokenizer):
    """include_stop_str_in_output (vLLM's): the text ends after the earliest match instead of before it, at
    the same token; the stop reason is the stop string matched (at a tie, the first one given)."""
    rng = random.Random(3)
    for ids in outputs(tokenizer):
        text = full_decode(tokenizer, ids)
        for _ in range(3 if text else 0):
            start = rng.randrange(len(text))
            stops = [text[start:start + rng.randrange(1, 8)], text[rng.randrange(len(text)):][:3]]
            cut, kept = make_request(tokenizer, stops), make_request(tokenizer, stops, include_stop_str_in_output=True)
            taken, end = first_stop(tokenizer, ids, stops)
            assert cut.commit_many(ids) == kept.commit_many(ids) == taken
            matched = min((s for s in stops if s in full_decode(tokenizer, ids[:taken])),
                          key=lambda s: full_decode(tokenizer, ids[:taken]).find(s))
            assert cut.stop_reason == kept.stop_reason == matched
            assert (cut.stop_text_end, kept.stop_text_end) == (end, end + len(matched))
            assert final_text(tokenizer, kept) == final_text(tokenizer, cut) + matched


def test_the_ending_token_is_left_out_of_the_text_unless_asked():
    """As vLLM's: the end-of-sequence or stop token id that ended an answer is among its tokens but not in its
    text, unless include_stop_str_in_output; the stop reason is a stop token id's, None for end of sequence."""
    tokenizer = as_transformers(bytelevel_tokenizer())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Hello world. More")
    stop_id = ids[2]
    cases = [(dict(stop_token_ids=[stop_id]), ids, stop_id, 3),
             (dict(skip_special_tokens=False), ids[:4] + [eos], None, 5)]
    for params, answer, reason, count in cases:
        for include in (False, True):
            request = Request(0, [1], SamplingParams(include_stop_str_in_output=include, **params), frozenset({eos}))
            assert request.commit_many(answer) == count and request.finish_reason == "stop"
            assert request.stop_reason == reason and request.ended_by_token
            shown = answer[:count] if include else answer[:count - 1]
            assert final_text(tokenizer, request) == full_decode(tokenizer, shown, skip_special_tokens=False)
    assert "<|im_end|>" in full_decode(tokenizer, ids[:4] + [eos], skip_special_tokens=False)


def test_no_tokenizer_without_stop_strings():
    request = Request(0, [1], SamplingParams(max_new_tokens=3), frozenset({2}))
    assert request.commit_many([5, 6, 7]) == 3 and request.finish_reason == "length"
    assert request.detokenizer is None


# ---- streaming through LLM.generate ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    """A random tiny model with a real (byte-level) tokenizer saved beside it: LLM loads it as any HF dir."""
    from specdec import LLM
    from tests.conftest import build_tiny_model_with_tokenizer

    path = tmp_path_factory.mktemp("tiny-llm-with-tokenizer")
    build_tiny_model_with_tokenizer(path)
    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=512, page_size=4)


def stream(llm, prompts, params):
    pieces = {}
    results = llm.generate(prompts, params, on_text=lambda i, text: pieces.setdefault(i, []).append(text))
    return results, pieces


def test_streamed_pieces_add_up_to_final_text(tiny_llm):
    prompts = ["Hello world", "The quick brown fox", "naïve café 😀"]
    params = SamplingParams(max_new_tokens=100, temperature=1.0, seed=3, ignore_eos=True)
    results, pieces = stream(tiny_llm, prompts, params)
    for i, result in enumerate(results):
        assert result.text == full_decode(tiny_llm.tokenizer, result.token_ids)
        assert "".join(pieces[i]) == result.text
        assert len(pieces[i]) > 1

    # with stop strings taken from those texts: the pieces add up to the cut text, nothing past it shows
    stops = [result.text[40:43] for result in results]
    stopped, pieces = stream(tiny_llm, prompts, SamplingParams(max_new_tokens=100, temperature=1.0, seed=3,
                                                                 ignore_eos=True, stop=stops))
    for i, (free, result) in enumerate(zip(results, stopped)):
        assert result.finish_reason == "stop"
        assert result.text == free.text[:min(free.text.find(s) for s in stops if s in free.text)]
        assert "".join(pieces.get(i, [])) == result.text


def test_streaming_decodes_a_bounded_number_of_tokens_per_commit(tiny_llm, monkeypatch):
    """Decoding the whole output at each commit would be quadratic: each committed token decodes a
    bounded window (the previous emission's tokens as context, twice, and the held-back ones), and
    the only full decodes are the final text's."""
    from specdec.engine.detokenizer import IncrementalDetokenizer

    counting = DecodeOnly(tiny_llm.tokenizer)
    per_push = []
    push = IncrementalDetokenizer.push

    def counted_push(self, token_id):
        before = counting.tokens_decoded
        text = push(self, token_id)
        per_push.append(counting.tokens_decoded - before)
        return text

    monkeypatch.setattr(IncrementalDetokenizer, "push", counted_push)
    original = tiny_llm.tokenizer
    tiny_llm.tokenizer = counting
    try:
        n = 300
        result = tiny_llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=n, temperature=1.0, seed=5,
                                                               ignore_eos=True), on_text=lambda i, text: None)[0]
    finally:
        tiny_llm.tokenizer = original
    assert len(result.token_ids) == n and len(per_push) == n
    assert max(per_push) <= 3 * MAX_PENDING
    assert counting.tokens_decoded <= 8 * n + 2 * n  # the windows, plus the final text decoded twice


def test_streaming_with_several_tokens_per_commit(tiny_llm):
    """Speculative steps commit a block of tokens at once: the pieces still add up to the final text,
    with and without stop strings (the request built here is fed as the speculator feeds it)."""
    tokenizer = tiny_llm.tokenizer
    rng = random.Random(4)
    for text in TEXTS:
        ids = encode(tokenizer, text)
        for stop in (None, [text[len(text) // 2:len(text) // 2 + 3]], ["o", "\n"]):
            request = make_request(tokenizer, stop=stop, max_new_tokens=len(ids))
            pieces, finals = [], []
            on_commit = tiny_llm._callbacks([text], [request], lambda i, piece: pieces.append(piece),
                                            lambda i, result: finals.append(result.text))
            while not request.finished:
                block = ids[len(request.output_ids):][:rng.randrange(1, 6)]
                taken = request.commit_many(block)
                on_commit(request, block[:taken])
            assert finals == [final_text(tokenizer, request)]
            assert "".join(pieces) == finals[0]
            stopped = stop is not None and any(s in text for s in stop)
            assert request.finish_reason == ("stop" if stopped else "length")
            if stopped:
                assert finals[0] == text[:min(text.find(s) for s in stop if s in text)]
            else:
                assert finals[0] == full_decode(tokenizer, ids) == text

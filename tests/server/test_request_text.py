"""The server's side of a request: text and stop strings from the token ids the engine loop ships."""

from specdec.engine.request import Request
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.text_stream import final_text
from specdec.server.engine_loop import RequestOutput
from specdec.server.request_text import RequestText, engine_params
from tests.tokenizer_helpers import as_transformers, bytelevel_tokenizer

TOKENIZER = as_transformers(bytelevel_tokenizer())
ANSWER = TOKENIZER.encode("The quick brown fox jumps over the lazy dog. Hello world")


def library(params: SamplingParams) -> tuple[str, int, str]:
    """What the engine itself makes of ANSWER with these params: (text, tokens taken, finish reason)."""
    request = Request(0, [1], params, frozenset())
    request.use_detokenizer(TOKENIZER)
    taken = request.commit_many(ANSWER)
    if not request.finished:
        request.finish("length")
    return final_text(TOKENIZER, request), taken, request.finish_reason


def serve(params: SamplingParams, batches: list[int], engine_reason: str | None = None) -> tuple[str, int, str, bool]:
    """ANSWER arriving in batches of these sizes through RequestText; the engine finishes with the last
    batch when it has an `engine_reason` (the engine runs without the stop strings: it may run on)."""
    text, pieces, start, out = RequestText([1], params, TOKENIZER), [], 0, None
    for i, size in enumerate(batches):
        last = i == len(batches) - 1 and engine_reason is not None
        out = text.update(RequestOutput("", ANSWER[start:start + size], last, engine_reason if last else None,
                                        prompt_tokens=1))
        pieces.append(out.text)
        start += size
        if out.finished:
            break
    return "".join(pieces), out.completion_tokens, out.finish_reason, text.stopped_early


def test_stop_strings_end_where_the_engine_would_end_them():
    params = SamplingParams(max_new_tokens=100, stop=("lazy",))
    want, taken, reason = library(params)
    assert reason == "stop" and want.endswith("over the ")
    for batches in ([len(ANSWER)], [1] * len(ANSWER), [3, 5, 2, len(ANSWER)]):
        text, tokens, got_reason, early = serve(params, batches)
        assert (text, tokens, got_reason, early) == (want, taken, "stop", True), batches
    # the engine ended in the same batch (say its EOS came later in it): nothing left to abort
    assert serve(params, [len(ANSWER)], engine_reason="stop") == (want, taken, "stop", False)
    assert engine_params(params).stop is None and engine_params(params).max_new_tokens == 100


def test_without_a_stop_the_engine_decides():
    params = SamplingParams(max_new_tokens=len(ANSWER))
    text, tokens, reason, early = serve(params, [4, 4, len(ANSWER)], engine_reason="length")
    assert (text, tokens, reason, early) == (TOKENIZER.decode(ANSWER), len(ANSWER), "length", False)
    assert engine_params(params) is params


def test_streamed_pieces_never_show_text_past_a_stop():
    params = SamplingParams(max_new_tokens=100, stop=("fox jumps over",))
    request = Request(0, [1], params, frozenset())
    request.use_detokenizer(TOKENIZER)
    text = RequestText([1], params, TOKENIZER)
    shown = ""
    for token in ANSWER:
        out = text.update(RequestOutput("", [token], prompt_tokens=1))
        shown += out.text
        assert "fox jumps" not in shown
        if out.finished:
            break
    assert shown == "The quick brown " and out.finish_reason == "stop"


def test_an_engine_error_reaches_the_client():
    text = RequestText([1], SamplingParams(stop=("x",)), TOKENIZER)
    out = text.update(RequestOutput("", [], True, "error", "the engine failed"))
    assert (out.finished, out.finish_reason, out.error, out.text, text.stopped_early) == (
        True, "error", "the engine failed", "", False)


def test_an_ending_id_ends_the_text_as_in_the_library():
    """The mirror knows the engine's ending ids: a stop token id (or end of sequence) the engine ended on is left
    out of the text unless include_stop_str_in_output, and is the stop reason, as in the library; nothing to abort."""
    stop_id = ANSWER[4]
    for include in (False, True):
        params = SamplingParams(max_new_tokens=100, stop_token_ids=[stop_id], include_stop_str_in_output=include)
        want, taken, reason = library(params)
        for batches in ([len(ANSWER)], [2, 3, len(ANSWER)]):
            # the engine ends on the same token: it ships tokens up to it and finishes
            text, pieces, start = RequestText([1], params, TOKENIZER, frozenset({ANSWER[-1]})), [], 0
            for size in batches:
                chunk = ANSWER[start:min(start + size, taken)]
                out = text.update(RequestOutput("", chunk, start + size >= taken, "stop" if start + size >= taken
                                                else None, prompt_tokens=1))
                pieces.append(out.text)
                start += size
                if out.finished:
                    break
            assert ("".join(pieces), out.completion_tokens, out.finish_reason, out.stop_reason,
                    text.stopped_early) == (want, taken, reason, stop_id, False)
        assert want == TOKENIZER.decode(ANSWER[:taken if include else taken - 1])

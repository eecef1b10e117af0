"""What stands between a request and its first token on the server's side: the request reaches the engine before
the response is set up (and is aborted however that response ends), and the engine loop hands a request its first
tokens as they are committed, ahead of the rest of the step."""

from __future__ import annotations

import asyncio

import pytest

from specdec import LLM, SamplingParams
from specdec.server.async_engine import AsyncEngine
from specdec.server.engine_loop import Abort, EngineLoop, Submit
from specdec.server.openai_api import ChoiceOutputs, EventStream
from tests.conftest import build_tiny_model_with_tokenizer
from tests.tokenizer_helpers import as_transformers, bytelevel_tokenizer


class RecordingEngine(AsyncEngine):
    """The callers' side alone: the commands it would send to an engine, recorded."""

    healthy = True

    def __init__(self):
        super().__init__(None, as_transformers(bytelevel_tokenizer()), frozenset())
        self.sent: list[Submit | Abort] = []

    def _send(self, command) -> None:
        self.sent.append(command)


def test_requests_reach_the_engine_before_the_response_and_end_with_it():
    async def scenario():
        engine = RecordingEngine()
        outputs = await ChoiceOutputs.start(engine.generate_samples([5, 6, 7], SamplingParams(max_new_tokens=4, n=2)))
        submitted = list(engine.sent)  # before any response exists

        async def events():  # never read: the client is gone before the response starts
            raise AssertionError("read")
            yield ""

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            raise OSError("the client went away")

        with pytest.raises(OSError):
            await EventStream(events(), outputs)({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return submitted, engine.sent[len(submitted):]

    submitted, after = asyncio.run(scenario())
    first, second = submitted
    assert isinstance(first, Submit) and isinstance(second, Submit) and (first.lead, second.lead) == (None, first.sid)
    assert sorted((type(c), c.sid) for c in after) == [(Abort, first.sid), (Abort, second.sid)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("first_token") / "target")), device="cpu",
               num_kv_pages=64, page_size=4)


@pytest.mark.parametrize("max_new_tokens", [1, 5])
def test_first_tokens_leave_the_engine_loop_as_they_are_committed(llm, max_new_tokens):
    prompt, params = [3, 14, 15, 92, 65], SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    [want] = llm.generate([prompt], params)
    loop = EngineLoop(llm.engine)
    early, outputs = [], loop.apply(Submit(7, prompt, params))
    while loop.busy:
        outputs += loop.step(early.extend)
    if max_new_tokens == 1:  # finished by its first token: sent once, with its finish reason
        assert early == [] and [(o.token_ids, o.finish_reason) for _, o in outputs] == [(want.token_ids, "length")]
        return
    assert [(sid, out.token_ids, out.finished) for sid, out in early] == [(7, want.token_ids[:1], False)]
    assert [t for _, out in early + outputs for t in out.token_ids] == want.token_ids  # none twice, none lost
    assert outputs[-1][1].finish_reason == "length" and outputs[-1][1].completion_tokens == max_new_tokens

"""A server started with an API key: the official client with the key is served, one without it or with another
is refused with 401 before its body is read, health probes and metric scrapes need no key; the command line takes
the key from --api-key or the environment and refuses one that cannot travel in a header before loading a model."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec import LLM
from specdec.serve import build_parser, chosen_api_key
from specdec.server.api_key import API_KEY_ENV
from specdec.server.async_engine import ThreadedEngine
from specdec.server.openai_api import build_app
from tests.conftest import build_tiny_model_with_tokenizer
from tests.server_helpers import ThreadServer
from tests.tokenizer_helpers import CHAT_TEMPLATE

MODEL = "tiny"
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target = build_tiny_model_with_tokenizer(tmp_path_factory.mktemp("api-key") / "target", chat_template=CHAT_TEMPLATE)
    llm = LLM(str(target), device="cpu", num_kv_pages=64, page_size=4)
    with ThreadServer(build_app(ThreadedEngine(llm), MODEL, api_key=KEY)) as running:
        yield running


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_the_client_with_the_key_is_served(server):
    answer = client(server, KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    assert [m.id for m in client(server, KEY).models.list()] == [MODEL]


@pytest.mark.parametrize("key", ["sk-other", KEY + "x", KEY[:-1]])
def test_another_key_is_refused(server, key):
    with pytest.raises(openai.AuthenticationError, match="not this server's") as refused:
        client(server, key).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert refused.value.code == "invalid_api_key" and KEY not in str(refused.value.body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/reset_prefix_cache", "/docs"])
def test_a_request_without_the_key_gets_401_unread(server, path):
    # a body far over the default limit: refused for the key before any of it is read
    answer = httpx.post(f"{server.base_url}{path}", content=b"{" * (16 << 20), timeout=30)
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert "Authorization: Bearer" in answer.json()["error"]["message"]


def test_the_scheme_may_be_written_in_any_case_and_the_key_may_not(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"bearer {KEY}"}, timeout=30).status_code == 200
    assert httpx.post(f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY.upper()}"}, timeout=30).status_code == 401
    assert httpx.post(f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": KEY}, timeout=30).status_code == 401


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "specdec_" in metrics.text


def test_the_command_line_takes_the_key_from_the_flag_then_the_environment(monkeypatch):
    parser = build_parser()
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert chosen_api_key(parser.parse_args([])) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert chosen_api_key(parser.parse_args([])) == "from-env"
    assert chosen_api_key(parser.parse_args(["--api-key", "from-flag"])) == "from-flag"


@pytest.mark.parametrize("key", ["", "two words", "tab\there", "ключ"])
def test_a_key_that_cannot_travel_in_a_header_is_refused_before_the_model_loads(key, capsys):
    from specdec.serve import main

    assert main(["--api-key", key, "--target", "/nonexistent/model"]) == 2
    assert "API key" in capsys.readouterr().err

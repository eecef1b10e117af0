"""The model's generation config as the defaults of sampling settings a request leaves out (--generation-config),
as vLLM's and SGLang's servers take it: read from the model's folder, another folder or not at all, checked when
the server starts, and overridden by whatever the request gives."""

from __future__ import annotations

import json

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.server.async_engine import ThreadedEngine
from specdec.server.openai_api import build_app
from specdec.server.openai_protocol import CompletionRequest
from specdec.server.sampling_defaults import sampling_defaults
from tests.conftest import build_tiny_model_with_tokenizer
from tests.server_helpers import ThreadServer

QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.7, "top_k": 20,
             "top_p": 0.8, "repetition_penalty": 1.05}


def folder_with(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_sampling_settings_are_read_from_the_generation_config(tmp_path):
    folder = folder_with(tmp_path, QWEN_LIKE)
    want = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    assert sampling_defaults("auto", folder) == sampling_defaults(folder, None) == want
    assert sampling_defaults("none", folder) == {}
    assert sampling_defaults("auto", tmp_path / "elsewhere") == {}  # a model without one: OpenAI's defaults


@pytest.mark.parametrize("config, words", [({"top_p": 2.0}, "top_p"), ("not an object", "JSON object")])
def test_a_bad_generation_config_is_refused_naming_its_file(tmp_path, config, words):
    with pytest.raises(ValueError, match=words) as refused:
        sampling_defaults("auto", folder_with(tmp_path, config))
    assert "generation_config.json" in str(refused.value)
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path / "missing"), None)


def test_what_a_request_gives_wins_over_the_defaults():
    defaults = {"temperature": 0.7, "top_k": 20, "min_p": 0.05}
    left_out = CompletionRequest(model="m", prompt="x").sampling_params(5, defaults)
    assert (left_out.temperature, left_out.top_k, left_out.min_p, left_out.top_p) == (0.7, 20, 0.05, 1.0)
    given = CompletionRequest(model="m", prompt="x", temperature=0.0, top_k=-1, min_p=0.0).sampling_params(5, defaults)
    assert (given.temperature, given.top_k, given.min_p) == (0.0, 0, 0.0)
    null = CompletionRequest(model="m", prompt="x", temperature=None).sampling_params(5, defaults)
    assert null.temperature == 0.7
    assert CompletionRequest(model="m", prompt="x").sampling_params(5).temperature == 1.0  # OpenAI's default


def test_a_server_answers_with_the_models_defaults_unless_told_otherwise(tmp_path):
    target = build_tiny_model_with_tokenizer(tmp_path / "target")
    llm = LLM(str(target), None, device="cpu", num_kv_pages=64, page_size=4)
    prompt = "The cache holds pages"
    greedy = llm.generate([prompt], SamplingParams(max_new_tokens=8))[0].text
    sampled = llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3))[0].text
    with ThreadServer(build_app(ThreadedEngine(llm), "tiny", sampling_defaults={"temperature": 0.0})) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert client.completions.create(model="tiny", prompt=prompt, max_tokens=8).choices[0].text == greedy
        told = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=3)
        assert told.choices[0].text == sampled != greedy

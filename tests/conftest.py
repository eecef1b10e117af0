"""Tiny random-weight models built in the test session (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tests.tokenizer_helpers import as_transformers, bytelevel_tokenizer

VOCAB = 96


def tiny_config(model_type: str, **overrides):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    common.update(overrides)
    if model_type == "llama":
        common.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        return LlamaConfig(**common)
    if model_type == "qwen2":
        return Qwen2Config(**common)
    if model_type == "qwen3":
        return Qwen3Config(head_dim=32, **common)
    raise ValueError(model_type)


def build_tiny_model(model_type: str, path, seed: int = 0, **overrides):
    """Save a random HF model of `model_type` to `path`; returns the HF model (fp32, eval)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random weights large enough that logits are far from uniform
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return model


def build_tiny_model_with_tokenizer(path, chat_template: str | None = None, **overrides):
    """A random tiny qwen2 model with a real byte-level tokenizer (no chat template unless given) saved
    beside it, so `LLM(path)` loads it as any HF model directory."""
    tokenizer = as_transformers(bytelevel_tokenizer(), eos_token="<|endoftext|>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    build_tiny_model("qwen2", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def calibration_cache_in_tmp(tmp_path_factory):
    """Measurements the library caches about a model (FP8 layer errors) go to a temporary directory, not
    the user's cache: the tests' models are temporary. Session-wide, so module fixtures see it too."""
    import specdec.llm

    cache = tmp_path_factory.getbasetemp() / "specdec-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(specdec.llm, "default_cache_dir", lambda: cache)
        yield


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = build_tiny_model(request.param, path)
    return path, hf

"""Broken model files and odd prompt types get one clear message naming the file and the fix."""

import os

import numpy as np
import pytest
import torch

from specdec.engine.config import EngineConfig
from tests.conftest import build_tiny_model_with_tokenizer
from tests.drafter_helpers import build_random_drafter


def llm(path):
    from specdec import LLM

    return LLM(str(path), device="cpu", dtype="float32", num_kv_pages=64, page_size=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("load-errors")
    build_tiny_model_with_tokenizer(path)
    return path


def copy_without(src, dst, skip):
    dst.mkdir()
    for f in src.iterdir():
        if not any(f.match(pattern) for pattern in skip):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_model_without_tokenizer_files_is_refused(model_dir, tmp_path):
    bare = copy_without(model_dir, tmp_path / "bare", ["tokenizer*", "vocab.json", "merges.txt", "special_tokens*"])
    with pytest.raises(ValueError, match="no tokenizer files"):
        llm(bare)


def test_config_without_weights_is_refused(model_dir, tmp_path):
    empty = copy_without(model_dir, tmp_path / "empty", ["*.safetensors"])
    with pytest.raises(ValueError, match="no weights"):
        llm(empty)


def test_truncated_weights_name_the_directory(model_dir, tmp_path):
    broken = copy_without(model_dir, tmp_path / "broken", [])
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot read the model weights in .*broken"):
        llm(broken)


def test_truncated_drafter_weights_name_the_file(tmp_path):
    from drafters.dflash_model import load_dflash
    from tests.conftest import tiny_config

    build_random_drafter(tmp_path / "drafter", tiny_config("qwen3"))
    weights = tmp_path / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(ValueError, match="cannot read the drafter weights .*model.safetensors"):
        load_dflash(tmp_path / "drafter", torch.device("cpu"), torch.float32)


def test_corrupt_gguf_names_the_file(tmp_path, monkeypatch):
    from specdec.weights.demo_models import resolve_model

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    with pytest.raises(ValueError, match="cannot convert .*broken.gguf"):
        resolve_model(str(bad))


def test_token_id_prompts_may_be_numpy_or_tensors(model_dir):
    model = llm(model_dir)
    want = model.generate([[5, 6, 7]], None)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        assert model.generate(prompt)[0].token_ids == want
    assert [r.token_ids for r in model.generate(np.array([[5, 6, 7], [5, 6, 7]]))] == [want, want]
    with pytest.raises(ValueError, match="flat list of integer token ids"):
        model.generate([[5, [6]]])


@pytest.mark.parametrize("device", ["gpu", "mps", "tpu", "cuda:x"])
def test_unknown_device_strings_are_refused(device):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(device=device)

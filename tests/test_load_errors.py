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


# ---- malformed model and drafter files: one ValueError naming the file, the field and the fix ------------
def edited_copy(model_dir, dst, config_edit=None, weights_edit=None):
    """A copy of the model with its config.json (a dict -> new JSON value) or weights (a dict) edited."""
    import json

    from safetensors.torch import load_file, save_file

    copy = copy_without(model_dir, dst, [])
    if config_edit is not None:
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(config_edit(config)))
    if weights_edit is not None:
        weights = load_file(copy / "model.safetensors")
        save_file(weights_edit(weights), copy / "model.safetensors")
    return copy


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "must hold a JSON object, got a list"),
    (lambda c: {**c, "hidden_size": "wide"}, "hidden_size"),
    (lambda c: {**c, "num_hidden_layers": -2}, "num_hidden_layers"),
    (lambda c: {**c, "vocab_size": 0}, "vocab_size=0.*positive integer"),
    (lambda c: {**c, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_malformed_target_configs_are_named(model_dir, tmp_path, edit, message):
    broken = edited_copy(model_dir, tmp_path / "broken", config_edit=edit)
    with pytest.raises(ValueError, match=f"config.json(.|\n)*{message}"):
        llm(broken)


def test_a_config_that_is_not_json_is_named_as_the_config(model_dir, tmp_path):
    broken = copy_without(model_dir, tmp_path / "broken", [])
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*config.json.*JSON config"):  # not "the tokenizer"
        llm(broken)


def test_a_target_missing_its_output_head_is_refused(model_dir, tmp_path):
    """Untied, without lm_head.weight: transformers would initialise a random head and generate garbage."""
    broken = edited_copy(model_dir, tmp_path / "headless", config_edit=lambda c: {**c, "tie_word_embeddings": False},
                         weights_edit=lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match="lack 1 of the model's parameters .*lm_head.weight"):
        llm(broken)


def test_weights_of_another_shape_than_the_config_are_named_as_such(model_dir, tmp_path):
    broken = edited_copy(model_dir, tmp_path / "resized", config_edit=lambda c: {**c, "intermediate_size": 40})
    with pytest.raises(ValueError, match="do not match its config.json"):
        llm(broken)


def test_an_empty_directory_is_not_called_an_unknown_model(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a model directory: it has no config.json"):
        llm(tmp_path / "empty")


def with_block(config: dict, block: int) -> dict:
    """The drafter config with `block` as its block size, where it is read (dflash_config wins)."""
    return {**config, "block_size": block, "dflash_config": {**config.get("dflash_config", {}), "block_size": block}}


@pytest.mark.parametrize("edit, message", [
    (lambda c: [c], "must hold a JSON object"),
    (lambda c: with_block(c, 100000), r"block_size must be an integer in \[2, 64\]"),
    (lambda c: with_block(c, 1), r"block_size must be an integer in \[2, 64\]"),
    (lambda c: {**c, "intermediate_size": 12}, "do not match its config.json"),
])
def test_malformed_drafters_are_named(tmp_path, edit, message):
    """A block of 100000 was accepted once and died allocating 160 GB."""
    import json

    from drafters.dflash_model import load_dflash
    from tests.conftest import tiny_config

    build_random_drafter(tmp_path / "drafter", tiny_config("qwen3"))
    config_file = tmp_path / "drafter" / "config.json"
    config_file.write_text(json.dumps(edit(json.loads(config_file.read_text()))))
    with pytest.raises(ValueError, match=message):
        load_dflash(tmp_path / "drafter", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("setting, value", [
    ("num_kv_pages", "8"), ("max_num_seqs", 1.5), ("page_size", True), ("enforce_eager", "no"),
    ("gpu_memory_utilization", float("nan")), ("verify", 3), ("tree_nodes", "63"),
])
def test_engine_settings_of_the_wrong_type_are_value_errors(setting, value):
    with pytest.raises(ValueError, match=f"{setting} must be"):
        EngineConfig(**{setting: value})


def test_the_library_speculates_with_a_shipped_drafter_by_default(model_dir, tmp_path, monkeypatch):
    """As the command line does: `drafter="auto"` takes the target's shipped drafter; None decodes plainly."""
    from transformers import AutoConfig

    from specdec import LLM

    build_random_drafter(tmp_path / "shipped", AutoConfig.from_pretrained(model_dir), block_size=4)
    monkeypatch.setattr("specdec.llm.DEFAULT_DRAFTERS", {str(model_dir): str(tmp_path / "shipped")})
    options = dict(device="cpu", dtype="float32", num_kv_pages=64, page_size=4)
    assert LLM(str(model_dir), **options).engine.drafter is not None
    assert LLM(str(model_dir), None, **options).engine.drafter is None
    monkeypatch.setattr("specdec.llm.DEFAULT_DRAFTERS", {})
    assert LLM(str(model_dir), **options).engine.drafter is None  # no shipped drafter: plain decoding

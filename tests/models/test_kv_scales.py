"""FP8 KV scales carried by a checkpoint (vLLM / llm-compressor names) reach the cache."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.models.kv_scales import read_kv_scales
from specdec.models.loader import load_target
from tests.conftest import build_tiny_model, build_tiny_model_with_tokenizer

LAYERS = 4


def with_scales(path, scales: dict[str, torch.Tensor]):
    """The tiny model's checkpoint with extra scale tensors written into its safetensors file."""
    build_tiny_model("qwen2", path, seed=1, num_hidden_layers=LAYERS)
    weights = path / "model.safetensors"
    save_file({**load_file(weights), **scales}, weights, metadata={"format": "pt"})
    return path


def test_scales_are_read_under_each_name(tmp_path):
    build_tiny_model("qwen2", tmp_path / "plain", seed=1, num_hidden_layers=LAYERS)
    assert read_kv_scales(tmp_path / "plain", LAYERS) is None
    named = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.5 + i) for i in range(LAYERS)}
    named |= {f"model.layers.{i}.self_attn.v_proj.output_scale": torch.tensor([0.1, 0.3]) for i in range(LAYERS)}
    scales = read_kv_scales(with_scales(tmp_path / "named", named), LAYERS)
    assert scales.k == (0.5, 1.5, 2.5, 3.5)
    assert scales.v == pytest.approx((0.3,) * LAYERS)  # per-head scales: the largest head's
    both = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(2.0) for i in range(LAYERS)}
    assert read_kv_scales(with_scales(tmp_path / "both", both), LAYERS).v == (2.0,) * LAYERS


def test_partial_or_bad_scales_are_refused(tmp_path):
    partial = {"model.layers.0.self_attn.k_scale": torch.tensor(1.0), "model.layers.0.self_attn.v_scale": torch.tensor(1.0)}
    with pytest.raises(ValueError, match=r"no k_scale for layers \[1, 2, 3\]"):
        read_kv_scales(with_scales(tmp_path / "partial", partial), LAYERS)
    zero = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.0 if i == 2 else 1.0) for i in range(LAYERS)}
    with pytest.raises(ValueError, match="non-positive"):
        read_kv_scales(with_scales(tmp_path / "zero", zero), LAYERS)


def test_an_fp8_cache_takes_the_checkpoints_scales(tmp_path):
    path = build_tiny_model_with_tokenizer(tmp_path / "model")
    layers = load_target(path, torch.device("cpu"), torch.float32).model.config.num_hidden_layers
    weights = path / "model.safetensors"
    scales = {f"model.layers.{i}.self_attn.{n}": torch.tensor(s) for i in range(layers)
              for n, s in (("k_scale", 0.25 * (i + 1)), ("v_scale", 0.125))}
    save_file({**load_file(weights), **scales}, weights, metadata={"format": "pt"})
    target = load_target(path, torch.device("cpu"), torch.float32)
    engine = Engine(target, EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_pages=64, page_size=4,
                                         kv_cache_full_precision_layers="none"), None)
    assert [layer.k_scale for layer in engine.kv.layers] == [0.25 * (i + 1) for i in range(layers)]
    assert {layer.v_scale for layer in engine.kv.layers} == {0.125}

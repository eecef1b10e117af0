"""An FP8 KV cache keeps the layers it would hold too coarsely in the model dtype.

A tiny Qwen2 target with a planted k_proj bias of 300 in a few channels of layer 0 (as Qwen2's layer 0
has ~360): e4m3 keys there ruin greedy output at once; with that layer kept in full precision (chosen
automatically from the calibration error) greedy output equals the full-precision cache's."""

import pytest
import torch

from attention.kv_cache import FP8_DTYPE, KVCache, layer_dtypes
from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, dflash_drafter, planted_model, spec_engine, tiny_target

PROMPTS = [p * 3 for p in MANY_PROMPTS]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-layers")
    planted_model(path)
    return path


def engine(target_dir, **config) -> Engine:
    return Engine(tiny_target(target_dir, ()), EngineConfig(device="cpu", num_kv_pages=512, page_size=4, **config),
                  None)


def outputs(e: Engine) -> list[list[int]]:
    return [r.output_ids for r in e.generate_ids(PROMPTS, PARAMS)]


def test_the_outlier_layer_is_kept_and_greedy_output_equals_full_precision(target_dir):
    reference = outputs(engine(target_dir))
    auto = engine(target_dir, kv_cache_dtype="fp8")
    assert auto.full_precision_layers == (0,)
    assert [layer.data.dtype for layer in auto.kv.layers] == [torch.float32] + [FP8_DTYPE] * 3
    assert outputs(auto) == reference
    everything_fp8 = engine(target_dir, kv_cache_dtype="fp8", kv_cache_full_precision_layers="none")
    assert everything_fp8.full_precision_layers == ()
    assert sum(a == b for a, b in zip(outputs(everything_fp8), reference)) < len(reference) // 2
    assert_no_leak(auto)


def test_layers_can_be_named_and_bad_names_are_refused(target_dir):
    assert engine(target_dir, kv_cache_dtype="fp8", kv_cache_full_precision_layers="2,0").full_precision_layers == (0, 2)
    assert engine(target_dir, kv_cache_full_precision_layers="0").full_precision_layers == ()  # bf16/fp32 cache
    with pytest.raises(ValueError, match="kv_cache_full_precision_layers must be"):
        EngineConfig(kv_cache_full_precision_layers="first")
    with pytest.raises(ValueError, match="names layers the model does not have"):
        engine(target_dir, kv_cache_dtype="fp8", kv_cache_full_precision_layers="0,9")


def test_pages_cost_what_their_layers_hold():
    mixed = layer_dtypes(4, FP8_DTYPE, (0,), torch.bfloat16)
    assert mixed == (torch.bfloat16, FP8_DTYPE, FP8_DTYPE, FP8_DTYPE)
    per_layer_fp8 = KVCache.bytes_per_page(1, 16, 2, 8, FP8_DTYPE)
    assert KVCache.bytes_per_page(4, 16, 2, 8, mixed) == 5 * per_layer_fp8
    cache = KVCache(4, 3, 16, 2, 8, mixed, "cpu")
    assert cache.is_fp8 and [layer.is_fp8 for layer in cache.layers] == [False, True, True, True]


def test_speculative_equals_autoregressive_with_kept_layers(target_dir, tmp_path):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = engine(target_dir, kv_cache_dtype="fp8")
    expected = [r.output_ids for r in ar.generate_ids(MANY_PROMPTS, params)]
    spec = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), kv_cache_dtype="fp8")
    assert spec.full_precision_layers == (0,)
    assert [r.output_ids for r in spec.generate_ids(MANY_PROMPTS, params)] == expected
    assert_no_leak(spec)


def test_the_calibration_is_cached(target_dir, tmp_path, monkeypatch):
    from specdec.models import kv_precision

    calls, real = [], kv_precision.fp8_errors
    monkeypatch.setattr(kv_precision, "fp8_errors", lambda *args: (calls.append(1), real(*args))[1])

    def cached_engine() -> Engine:
        target = tiny_target(target_dir, ())
        target.cache_dir = tmp_path / "cache"
        return Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4, kv_cache_dtype="fp8"), None)

    layers = [cached_engine().full_precision_layers for _ in range(2)]
    assert layers == [(0,), (0,)] and len(calls) == 1  # the second engine read the cache
    assert len(list((tmp_path / "cache").glob("*.json"))) == 1
    (target_dir / "config.json").touch()  # the model directory changed: computed again
    assert cached_engine().full_precision_layers == (0,) and len(calls) == 2

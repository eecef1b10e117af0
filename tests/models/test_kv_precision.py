"""Per-layer FP8 KV error against the model's own attention (specdec/models/kv_precision.py)."""

import statistics

import torch

from specdec.models.kv_precision import capture_attention, causal_attention, fp8_layer_errors, pair_smoothing
from tests.engine_helpers import planted_model


def test_a_layer_with_large_key_channels_stands_out(tmp_path):
    model = planted_model(tmp_path)
    ids = torch.arange(3, 83) % 90 + 3
    errors = fp8_layer_errors(model, ids)
    assert [e.layer for e in errors] == list(range(model.config.num_hidden_layers))
    assert errors[0].max_k > 100 > max(e.max_k for e in errors[1:])
    others = statistics.median(e.fp8 for e in errors[1:])
    assert errors[0].fp8 > 3 * others  # the planted layer's FP8 error is of another order
    assert errors[0].fp8_k_only > 3 * errors[0].fp8_v_only  # and it comes from its keys
    assert all(e.bf16 < e.fp8 for e in errors)
    assert fp8_layer_errors(model, ids) == errors  # deterministic


def test_smoothing_the_keys_is_exact_before_rounding(tmp_path):
    """Dividing K's RoPE pairs by a factor and multiplying Q by it leaves attention unchanged in fp32."""
    model = planted_model(tmp_path)
    q, k, v = capture_attention(model, torch.arange(5, 45))[0]
    smooth = pair_smoothing(k)
    assert smooth.max() > 10 and smooth.min() == 1.0
    group = q.shape[1] // k.shape[1]
    torch.testing.assert_close(causal_attention(q * smooth.repeat_interleave(group, dim=0), k / smooth, v),
                               causal_attention(q, k, v), atol=1e-4, rtol=1e-3)  # scores of ~1e3: fp32 rounding

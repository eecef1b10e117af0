"""TorchBackend equals a dense reference: causal / non-causal, mixed lengths, page boundaries, FP8."""

import pytest
import torch

from attention.kv_cache import FP8_DTYPE
from attention.torch_backend import TorchBackend
from tests.attention_cases import CASES, HKV, HQ, D, PagedCase


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kv_dtype,scales", [(torch.float32, (1.0, 1.0)), (FP8_DTYPE, (1.0, 1.0)),
                                             (FP8_DTYPE, (0.02, 0.05))])
def test_matches_dense(name, kv_dtype, scales):
    case = PagedCase(*CASES[name], kv_dtype=kv_dtype, scales=scales)
    backend = TorchBackend(HQ, HKV, D, D ** -0.5)
    backend.plan(case.layout)
    backend.write_kv(case.layer, case.new_k, case.new_v)
    out = backend.attend(case.q, case.layer)
    torch.testing.assert_close(out, case.expected(D ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["noncausal_context_plus_block", "noncausal_block", "verify_page_boundaries"])
@pytest.mark.parametrize("window_left", [0, 3, 9, 100])
def test_a_sliding_window_matches_dense(name, window_left):
    """window_left: each query sees the keys from its position - window_left on (the drafter's `draft_window`); a
    window longer than the context changes nothing."""
    case = PagedCase(*CASES[name])
    backend = TorchBackend(HQ, HKV, D, D ** -0.5, window_left=window_left)
    backend.plan(case.layout)
    backend.write_kv(case.layer, case.new_k, case.new_v)
    out = backend.attend(case.q, case.layer)
    torch.testing.assert_close(out, case.expected(D ** -0.5, window_left), atol=1e-5, rtol=1e-5)
    if window_left == 100:
        torch.testing.assert_close(out, case.expected(D ** -0.5), atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(out, case.expected(D ** -0.5), atol=1e-3)


def test_fp8_roundtrip_error_is_bounded():
    case = PagedCase(*CASES["verify_page_boundaries"], kv_dtype=FP8_DTYPE)
    k = case.k_all[0]
    kq, _ = case.layer.quantize(k, k)
    rel = ((kq.float() - k).abs() / k.abs().clamp_min(1e-2)).median()
    assert rel < 0.07  # e4m3 keeps 3 mantissa bits: ~6% worst-case relative rounding


def test_rollback_then_reappend_reads_new_values():
    """Truncating a request and writing different K/V at the same positions must be what attention sees."""
    case = PagedCase([10], [6], [6], True, page_size=4)
    backend = TorchBackend(HQ, HKV, D, D ** -0.5)
    backend.plan(case.layout)
    backend.write_kv(case.layer, case.new_k, case.new_v)
    table = case.tables[0]
    table.truncate(12)  # reject the last 4 of the 6 new tokens
    table.grow(4)
    fresh_k, fresh_v = torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    case.k_all[0] = torch.cat([case.k_all[0][:12], fresh_k])
    case.v_all[0] = torch.cat([case.v_all[0][:12], fresh_v])
    from attention.batch_layout import BatchLayout

    case.layout = BatchLayout.for_tokens([4], [16], [table.pages], 4, causal=True)
    case.q = torch.randn(4, HQ, D)
    backend.plan(case.layout)
    backend.write_kv(case.layer, fresh_k, fresh_v)
    torch.testing.assert_close(backend.attend(case.q, case.layer), case.expected(D ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_fused_kv_pair_write_equals_two_writes(kv_dtype):
    """K and V that are neighbouring columns of one q|k|v buffer are written as one tensor; the cache
    must hold exactly what two separate writes store."""
    from attention.kv_cache import KVCache, _adjacent_pair

    qkv = torch.randn(5, (4 + 2 + 2) * 8, generator=torch.Generator().manual_seed(0)) * 50
    q, k, v = (p.view(5, h, 8) for p, h in zip(qkv.split([32, 16, 16], dim=-1), (4, 2, 2)))
    assert _adjacent_pair(k, v) is not None and _adjacent_pair(k.clone(), v.clone()) is None
    assert _adjacent_pair(q[:, 2:], k) is not None and _adjacent_pair(v, k) is None
    fused, separate = (KVCache(1, 4, 4, 2, 8, kv_dtype, "cpu") for _ in range(2))
    pages, offsets = torch.tensor([0, 1, 1, 3, 2]), torch.tensor([0, 3, 1, 2, 0])
    fused.layers[0].write(pages, offsets, k, v)
    separate.layers[0].write(pages, offsets, k.clone(), v.clone())
    assert torch.equal(fused.layers[0].data.view(torch.uint8), separate.layers[0].data.view(torch.uint8))

"""FlashInfer backend vs the torch reference on the same paged caches (GPU).

Bound: max |out - ref| / max |ref| <= 1e-2 with bf16 queries, for bf16 and e4m3 caches (the
reference reads the same stored, dequantized K/V, so FP8 rounding is common to both sides).
"""

import pytest
import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import FP8_DTYPE
from attention.torch_backend import TorchBackend
from tests.attention_cases import CASES, HKV, HQ, D, PagedCase

REL_BOUND = 1e-2
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}


def flashinfer_backend(*kv_dtypes):
    from attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(HQ, HKV, D, D ** -0.5, device=torch.device("cuda"), kv_dtypes=kv_dtypes,
                             q_dtype=torch.bfloat16)


def run(backend, case):
    backend.plan(case.layout)
    backend.write_kv(case.layer, case.new_k, case.new_v)
    return backend.attend(case.q, case.layer)


def rel_error(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_matches_reference(name, kv, page_size):
    history, new_kv, q_lens, causal = CASES[name]
    make = lambda: PagedCase(history, new_kv, q_lens, causal, page_size=page_size,  # noqa: E731
                             kv_dtype=KV_DTYPES[kv], device="cuda", dtype=torch.bfloat16,
                             scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
    ours, ref_case = make(), make()
    out = run(flashinfer_backend(KV_DTYPES[kv]), ours)
    ref = run(TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda"), ref_case)
    # both backends wrote the new tokens: the caches must hold the same bytes
    assert torch.equal(ours.layer.data.view(torch.uint8), ref_case.layer.data.view(torch.uint8))
    err = rel_error(out, ref)
    print(f"{name} {kv} page {page_size}: rel err {err:.2e}")
    assert err <= REL_BOUND


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_rollback_and_reappend(kv):
    """Verify 16 tokens, keep 5, append 16 new ones at the same slots: both backends agree."""
    cases = [PagedCase([21, 3], [16, 16], [16, 16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                       dtype=torch.bfloat16) for _ in range(2)]
    backends = [flashinfer_backend(KV_DTYPES[kv]), TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda")]
    outs = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for case, backend in zip(cases, backends):
        run(backend, case)
        for table in case.tables:
            table.truncate(table.length - 11)
            table.grow(16)
        layout = BatchLayout.for_tokens([16, 16], [t.length for t in case.tables], [t.pages for t in case.tables],
                                        16, causal=True)
        k = torch.randn(32, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(32, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        q = torch.randn(32, HQ, D, device="cuda", generator=g, dtype=torch.bfloat16)
        g.manual_seed(1)  # the same new values for both backends
        backend.plan(layout)
        backend.write_kv(case.layer, k, v)
        outs.append(backend.attend(q, case.layer))
    assert rel_error(outs[0], outs[1]) <= REL_BOUND


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_cache_mixing_dtypes_runs_each_layer_as_a_cache_of_its_own_dtype(name):
    """One backend for a cache whose layers are bf16 and e4m3 (an FP8 cache with kept layers): each
    layer's attention is bit for bit what a backend of that layer's dtype alone computes."""
    history, new_kv, q_lens, causal = CASES[name]
    mixed = flashinfer_backend(torch.bfloat16, FP8_DTYPE)
    for kv in KV_DTYPES.values():
        cases = [PagedCase(history, new_kv, q_lens, causal, page_size=16, kv_dtype=kv, device="cuda",
                           dtype=torch.bfloat16) for _ in range(2)]
        assert torch.equal(run(mixed, cases[0]), run(flashinfer_backend(kv), cases[1]))


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_token_tree_masks_match_reference(kv):
    """Each query sees its request's earlier KV and the new rows its mask allows (a token tree): FlashInfer's
    custom mask (fa2, packed on the GPU) against the torch reference, requests of different lengths."""
    g = torch.Generator(device="cuda").manual_seed(3)
    nodes = 9
    masks = (torch.rand(3, nodes, nodes, device="cuda", generator=g) < 0.4) | torch.eye(nodes, dtype=torch.bool,
                                                                                        device="cuda")
    masks = masks.tril()  # a tree's ancestors come before it
    cases = [PagedCase([40, 7, 130], [nodes] * 3, [nodes] * 3, True, page_size=16, kv_dtype=KV_DTYPES[kv],
                       device="cuda", dtype=torch.bfloat16, scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
             for _ in range(2)]
    outs = []
    for case, backend in zip(cases, [flashinfer_backend(KV_DTYPES[kv]), TorchBackend(HQ, HKV, D, D ** -0.5,
                                                                                     device="cuda")]):
        case.layout = case.layout.with_query_masks(masks)
        outs.append(run(backend, case))
    err = rel_error(*outs)
    print(f"tree masks {kv}: rel err {err:.2e}")
    assert err <= REL_BOUND
    # the masks matter: with plain causal order the outputs differ
    causal = PagedCase([40, 7, 130], [nodes] * 3, [nodes] * 3, True, page_size=16, kv_dtype=KV_DTYPES[kv],
                       device="cuda", dtype=torch.bfloat16, scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
    assert rel_error(run(flashinfer_backend(KV_DTYPES[kv]), causal), outs[1]) > 10 * REL_BOUND

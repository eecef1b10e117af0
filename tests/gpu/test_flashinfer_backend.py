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


def flashinfer_backend(*kv_dtypes, window_left: int = -1):
    from attention.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(HQ, HKV, D, D ** -0.5, device=torch.device("cuda"), kv_dtypes=kv_dtypes,
                             q_dtype=torch.bfloat16, window_left=window_left)


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


@pytest.mark.parametrize("name", ["noncausal_context_plus_block", "verify_page_boundaries"])
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("window_left", [0, 5, 17])
def test_a_sliding_window_matches_reference(name, kv, window_left):
    """FlashInfer's window_left (the drafter's `draft_window`) sees what the torch reference's window sees."""
    history, new_kv, q_lens, causal = CASES[name]
    make = lambda: PagedCase(history, new_kv, q_lens, causal, page_size=16, kv_dtype=KV_DTYPES[kv],  # noqa: E731
                             device="cuda", dtype=torch.bfloat16, scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
    ours, ref_case = make(), make()
    out = run(flashinfer_backend(KV_DTYPES[kv], window_left=window_left), ours)
    ref = run(TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda", window_left=window_left), ref_case)
    assert rel_error(out, ref) <= REL_BOUND


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


# (history, new_kv, q_lens, causal): short ones, and long ones, where a plan would split each request's KV
UPPER_BOUND_CASES = {"verify_page_boundaries": CASES["verify_page_boundaries"],
                     "noncausal_context_plus_block": CASES["noncausal_context_plus_block"],
                     "long_noncausal": ([700, 1500, 90], [32, 32, 32], [16, 16, 16], False),
                     "long_causal": ([1300, 600], [16, 16], [16, 16], True)}


@pytest.mark.parametrize("name", sorted(UPPER_BOUND_CASES))
@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("rung", [0, 8], ids=["exact-rung", "padded-rung"])
@pytest.mark.parametrize("window_left", [-1, 40], ids=["whole", "window"])
def test_a_graph_planned_for_upper_bounds_attends_over_the_real_lengths(name, kv, rung, window_left):
    """Drafting ahead: a graph rung planned for longer KV than the requests have (the pages past their real ends
    hold garbage) and given the real lengths on the device inside the graph attends exactly over the real KV:
    the torch reference of the real layout, and the rung's metadata is the real layout's."""
    from attention.flashinfer_backend import FlashInferBackend

    history, new_kv, q_lens, causal = UPPER_BOUND_CASES[name]
    case = PagedCase(history, new_kv, q_lens, causal, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                     dtype=torch.bfloat16, scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
    reference = TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda", window_left=window_left)
    expected = run(reference, case)  # also writes the new K/V
    real = case.layout
    extra = [5, 16, 23][:len(case.tables)]
    for table, more in zip(case.tables, extra):  # the upper bounds' slots, full of garbage
        start = table.length
        table.grow(more)
        slots = torch.tensor([table.slot(p) for p in range(start, table.length)], device="cuda")
        case.layer.write(slots // 16, slots % 16, *(1e3 * torch.randn(2, more, HKV, D, device="cuda")))
    upper = BatchLayout.build(real.q_lens, real.kv_lens + extra, real.new_kv_lens + extra,
                              [t.pages for t in case.tables], 16, causal)
    backend = FlashInferBackend(HQ, HKV, D, D ** -0.5, device=torch.device("cuda"), kv_dtypes=(KV_DTYPES[kv],),
                                q_dtype=torch.bfloat16, device_lengths=True, window_left=window_left)
    size = max(rung, upper.batch_size)
    slot = backend.graph_slot(size, 256, upper.padded(size, case.kv.scratch_page))
    lengths = torch.full((size,), 1 << 30, dtype=torch.int64, device="cuda")  # padding keeps its planned length
    lengths[:real.batch_size] = torch.from_numpy(real.kv_lens).cuda()
    q = case.q.clone()
    rows = len(q)
    queries = torch.zeros(size * int(upper.q_lens.max()), HQ, D, dtype=q.dtype, device="cuda")
    queries[:rows] = q
    padded = upper.padded(size, case.kv.scratch_page)

    def step():
        backend.use_device_lengths(lengths)
        return backend.attend(queries[:padded.num_queries], case.layer)

    backend.plan_graph(slot, upper, case.kv.scratch_page)
    step()  # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    backend.plan_graph(slot, upper, case.kv.scratch_page)
    with torch.cuda.graph(graph):
        out = step()
    backend.plan_graph(slot, upper, case.kv.scratch_page)
    graph.replay()
    torch.cuda.synchronize()
    assert slot.kv_indptr[:real.batch_size + 1].tolist() == real.kv_indptr().tolist()
    assert slot.last_page_len[:real.batch_size].tolist() == real.last_page_lens().tolist()
    assert slot.kv_indices[:len(real.kv_indices)].tolist() == real.kv_indices.tolist()
    err = rel_error(out[:rows], expected)
    print(f"{name} {kv} rung {size}: rel err {err:.2e}")
    assert err <= REL_BOUND

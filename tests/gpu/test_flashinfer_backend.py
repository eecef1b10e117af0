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
    """A backend as the runners make it: with room for its steps' write slots (the append kernel's)."""
    from attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(HQ, HKV, D, D ** -0.5, device=torch.device("cuda"), kv_dtypes=kv_dtypes,
                                q_dtype=torch.bfloat16, window_left=window_left)
    backend.reserve_write_rows(4096)
    return backend


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


def test_an_eager_plan_waits_until_the_last_eager_plans_copies_have_run():
    """FlashInfer's plan writes pinned host buffers of its wrapper, which the plan's copy to the GPU reads when the
    stream reaches it: written again before then, they hand the queued step the next step's plan (three engines
    sharing one H200 hit illegal memory accesses so, BENCHMARKS.md). So with the GPU busy (a spin kernel queued
    first), a second eager plan returns only once the first plan's copies have run."""
    first, second = (PagedCase(*CASES[name], page_size=16, kv_dtype=torch.bfloat16, device="cuda",
                               dtype=torch.bfloat16) for name in ("decode", "verify_page_boundaries"))
    backend = flashinfer_backend(torch.bfloat16)
    for case in (first, second):  # kernels loaded, buffers sized: the timed plans below do host work only
        backend.plan(case.layout)
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU time queued ahead of the first plan's copies
    backend.plan(first.layout)
    first_planned = torch.cuda.Event()
    first_planned.record()
    backend.plan(second.layout)
    assert first_planned.query(), "the second plan returned while the first plan's copies were still queued"
    torch.cuda.synchronize()


@pytest.mark.parametrize("rows", [1, 37, 300])
def test_the_append_kernel_stores_what_the_indexed_write_stores(rows):
    """A layer in the model's dtype is written by FlashInfer's append kernel: the bytes `LayerKV.write` stores, at the
    same slots, for the k|v columns of a fused q|k|v projection; a step's new slots are staged again."""
    from attention.kv_cache import LayerKV

    backend = flashinfer_backend(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    appended, indexed = (LayerKV(torch.zeros(65, 2, 16, HKV, D, dtype=torch.bfloat16, device="cuda")) for _ in range(2))
    for _ in range(2):  # two steps, each with slots of its own
        slots = torch.randperm(64 * 16, device="cuda", generator=g)[:rows]
        pages, offsets = slots // 16, slots % 16
        qkv = torch.randn(rows, (HQ + 2 * HKV) * D, device="cuda", generator=g, dtype=torch.bfloat16)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(rows, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(rows, HKV, D)
        backend.set_write_slots(pages, offsets)
        backend.write_kv(appended, k, v)
        indexed.write(pages, offsets, k, v)
        assert torch.equal(appended.data, indexed.data)
    assert appended.data.abs().sum() > 0


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
@pytest.mark.parametrize("history", [[40, 7, 130], [1300, 7, 2100]], ids=["short", "long"])
def test_token_tree_masks_match_reference(kv, history):
    """Each query sees its request's earlier KV and the new rows its mask allows (a token tree): FlashInfer's
    context part (paged fa2, split over long KV) and tree part (ragged fa2, the mask packed on the GPU) merged,
    against the torch reference, requests of different lengths."""
    g = torch.Generator(device="cuda").manual_seed(3)
    nodes = 9
    masks = (torch.rand(3, nodes, nodes, device="cuda", generator=g) < 0.4) | torch.eye(nodes, dtype=torch.bool,
                                                                                        device="cuda")
    masks = masks.tril()  # a tree's ancestors come before it
    make = lambda: PagedCase(history, [nodes] * 3, [nodes] * 3, True, page_size=16, kv_dtype=KV_DTYPES[kv],  # noqa: E731
                             device="cuda", dtype=torch.bfloat16, scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0))
    cases = [make() for _ in range(2)]
    outs = []
    for case, backend in zip(cases, [flashinfer_backend(KV_DTYPES[kv]), TorchBackend(HQ, HKV, D, D ** -0.5,
                                                                                     device="cuda")]):
        case.layout = case.layout.with_query_masks(masks)
        outs.append(run(backend, case))
    err = rel_error(*outs)
    print(f"tree masks {kv} {history}: rel err {err:.2e}")
    assert err <= REL_BOUND
    # the masks matter: with plain causal order the outputs differ
    assert rel_error(run(flashinfer_backend(KV_DTYPES[kv]), make()), outs[1]) > 10 * REL_BOUND


def replayed_rung(backend, slot, steps, queries_per_request: int, scratch: int):
    """Each of `steps` (cases over one layer of the same pool) planned into graph rung `slot`, its history copied into
    the first step's cache and its queries and new K/V into the rung's buffers, and the rung's graph (captured at the
    first step) replayed: yields (step, its rows of the replay's attention output) for each step."""
    from attention.batch_layout import slots_on_device

    rows = slot.batch_size * queries_per_request
    layer = steps[0].layer
    queries = torch.zeros(rows, HQ, D, dtype=torch.bfloat16, device="cuda")
    keys, values = (torch.zeros(rows, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    positions = torch.zeros(rows, dtype=torch.long, device="cuda")
    requests = torch.arange(slot.batch_size, device="cuda").repeat_interleave(queries_per_request)

    def forward():
        backend.set_write_slots(*slots_on_device(backend.kv_indices, backend.kv_indptr, requests, positions, 16))
        backend.write_kv(layer, keys, values)
        return backend.attend(queries, layer)

    graph = out = None
    for step in steps:
        layer.data.copy_(step.layer.data)
        n = len(step.q)
        for buffer, values_ in ((queries, step.q), (keys, step.new_k), (values, step.new_v)):
            buffer.zero_()
            buffer[:n].copy_(values_)
        positions.copy_(torch.from_numpy(step.layout.padded(slot.batch_size, scratch).new_kv_positions()).long())
        backend.plan_graph(slot, step.layout, scratch)
        if graph is None:
            forward()  # warm-up outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward()
        graph.replay()
        torch.cuda.synchronize()
        yield step, out[:n]


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_a_tree_graph_rung_attends_as_the_reference_for_every_step_it_replays(kv):
    """A token-tree rung of 4 (the context's pages in buffers of its own, the masks packed into its buffer at
    each plan), captured once and replayed for two steps of 3 requests with other contexts and masks: each
    replay writes the step's K/V and attends as the torch reference does."""
    g = torch.Generator(device="cuda").manual_seed(5)
    nodes, size = 7, 4
    scales = (0.05, 0.03) if kv == "fp8" else (1.0, 1.0)

    def tree_case(history, seed, masks):
        case = PagedCase(history, [nodes] * 3, [nodes] * 3, True, page_size=16, kv_dtype=KV_DTYPES[kv],
                         device="cuda", dtype=torch.bfloat16, scales=scales, seed=seed)
        case.layout = case.layout.with_query_masks(masks)
        return case

    steps, expected = [], []
    for seed, history in enumerate(([300, 20, 41], [5, 900, 64])):
        masks = ((torch.rand(3, nodes, nodes, device="cuda", generator=g) < 0.5)
                 | torch.eye(nodes, dtype=torch.bool, device="cuda")).tril()
        steps.append(tree_case(history, seed, masks))
        reference = tree_case(history, seed, masks)  # the same cache, queries and new K/V
        expected.append(run(TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda"), reference))
    backend = flashinfer_backend(KV_DTYPES[kv])
    scratch = steps[0].kv.scratch_page
    slot = backend.graph_slot(size, 256, steps[0].layout.padded(size, scratch))
    for (step, out), want in zip(replayed_rung(backend, slot, steps, nodes, scratch), expected):
        err = rel_error(out, want)
        print(f"tree rung {kv} {step.layout.kv_lens.tolist()}: rel err {err:.2e}")
        assert err <= REL_BOUND


class LoneRung:
    """A lone request's graph rung of q queries over one layer: captured at its first run (on the dummy layout,
    whose KV is one chunk), then each run plans the step's layout into it and replays. With `tree`, a token-tree
    rung: the dummy has query masks, and the step first makes its node rows' page metadata and copies from the masks
    on the device (`use_device_tree`), as the target's tree step does."""

    def __init__(self, backend, layer, q: int, scratch: int, tree: bool = False):
        from attention.batch_layout import slots_on_device

        self.backend, self.layer, self.scratch = backend, layer, scratch
        dummy = BatchLayout.dummy(1, q, q, 16, scratch, True)
        if tree:
            dummy = dummy.with_query_masks(torch.ones(q, q, dtype=torch.bool, device="cuda").tril()[None])
        self.slot = backend.graph_slot(1, 256, dummy)
        assert self.slot.rows == q and self.slot.node_rows == tree
        self.queries = torch.zeros(q, HQ, D, dtype=torch.bfloat16, device="cuda")
        self.keys, self.values = (torch.zeros(q, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        self.positions = torch.zeros(q, dtype=torch.long, device="cuda")
        self.requests = torch.zeros(q, dtype=torch.long, device="cuda")  # held: the graph reads it

        def forward():
            backend.use_device_tree()  # a no-op but for a tree rung
            backend.set_write_slots(*slots_on_device(backend.kv_indices, backend.kv_indptr, self.requests,
                                                     self.positions, 16))
            backend.write_kv(layer, self.keys, self.values)
            return backend.attend(self.queries, layer)

        backend.plan_graph(self.slot, dummy, scratch)
        self.positions.copy_(torch.arange(q))
        forward()  # warm-up outside the graph
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = forward()

    def run(self, layout: BatchLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kv_len: int | None = None) -> torch.Tensor:
        """With `kv_len`: the rung is planned for `layout` but the step's real KV length is that (shorter) one, which
        the device gives (`use_device_rows`), as for a verify queued before its start is known."""
        for buffer, values in ((self.queries, q), (self.keys, k), (self.values, v)):
            buffer.copy_(values)
        rows = int(layout.q_lens[0])
        self.positions.copy_(torch.from_numpy(layout.new_kv_positions()).long() if kv_len is None else
                             torch.arange(kv_len - rows, kv_len))
        self.backend.plan_graph(self.slot, layout, self.scratch)
        if kv_len is not None:
            self.backend.use_device_rows(torch.tensor([kv_len], device="cuda"))
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out.clone()


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_a_lone_requests_verify_rows_have_the_bits_of_its_decodes(kv):
    """A lone request's verify of 16 and its decodes at the same 16 positions, each replayed from a graph rung
    captured once on a dummy of one KV chunk: the verify attends as the reference, and each of its rows has the
    bits of the decode at that position, with a short history (one KV chunk per row) and long ones (several).
    A rung replans only when a row's number of chunks changes: after the history of 1,500 tokens, that of 1,502
    keeps both rungs' plans (every row still 5 chunks of 19 pages on a GPU of 132 SMs), and in that of 1,510 the
    rows reach a sixth chunk. The verify of a request's last block, whose rows run past its length, has the bits of
    the decodes there too."""
    scales = (0.05, 0.03) if kv == "fp8" else (1.0, 1.0)
    backend = flashinfer_backend(KV_DTYPES[kv])
    backend.bound_sequence_pages(256)
    expected = 2400  # the request's length at most: its KV chunks are 2416 / 16 tokens in up to 8 chunks
    cases = {h: PagedCase([h], [16], [16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                          dtype=torch.bfloat16, scales=scales, seed=h) for h in (30, 1500, 1502, 1510)}
    plans = []
    plan_wrappers = backend._plan_wrappers
    backend._plan_wrappers = lambda *args, **kwargs: plans.append(backend.slot) or plan_wrappers(*args, **kwargs)
    layer, scratch = cases[30].layer, cases[30].kv.scratch_page  # the graphs' cache: each case's copied in
    verify, decode = LoneRung(backend, layer, 16, scratch), LoneRung(backend, layer, 1, scratch)
    for history, case in cases.items():
        layer.data.copy_(case.layer.data)
        table = case.tables[0].array
        step = BatchLayout.for_tokens([16], [history + 16], [table], 16, causal=True, expected_kv_len=expected)
        rows = verify.run(step, case.q, case.new_k, case.new_v)
        err = rel_error(rows, case.expected(D ** -0.5))
        print(f"lone verify rows {kv} history {history}: rel err {err:.2e}")
        assert err <= REL_BOUND
        for j in range(16):
            one = BatchLayout.for_tokens([1], [history + j + 1], [table], 16, causal=True, expected_kv_len=expected)
            row = decode.run(one, case.q[j:j + 1], case.new_k[j:j + 1], case.new_v[j:j + 1])
            assert torch.equal(row[0], rows[j]), f"position {history + j}"
    if backend.split_items == 132:  # the chunks the docstring counts
        # per rung: the dummy it was captured on, 30, 1,500 and 1,510 (the verify's rows reach a sixth chunk there,
        # the decodes from position 1,520 on), never 1,502
        assert plans.count(verify.slot) == 4 and plans.count(decode.slot) == 4
    # the last block of a request: the verify's rows run up to 15 tokens past the request's length at most, and keep
    # its decodes' chunks (the length + 16 tokens fill a multiple of the chunks a row may have, so one page more would
    # have made each chunk a page larger)
    from attention.flashinfer_backend import LONE_ROWS_MAX

    end = 16 * 2 * (backend.split_items // LONE_ROWS_MAX) - 16
    case = PagedCase([end - 1], [16], [16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                     dtype=torch.bfloat16, scales=scales, seed=end)
    layer.data.copy_(case.layer.data)
    table = case.tables[0].array
    step = BatchLayout.for_tokens([16], [end + 15], [table], 16, causal=True, expected_kv_len=end)
    rows = verify.run(step, case.q, case.new_k, case.new_v)
    for j in range(16):
        one = BatchLayout.for_tokens([1], [end + j], [table], 16, causal=True, expected_kv_len=end)
        row = decode.run(one, case.q[j:j + 1], case.new_k[j:j + 1], case.new_v[j:j + 1])
        assert torch.equal(row[0], rows[j]), f"position {end - 1 + j} of a request of {end} tokens at most"


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_a_lone_verify_planned_for_a_later_start_has_the_bits_of_its_decodes(kv):
    """A verify queued before its start is known (`TargetRunner.run_block_ahead`): the rung planned for the latest
    start the step may have, with the real start's page metadata made on the device (`use_device_rows`), gives each
    row the bits of the decode at its position, for every start up to 15 before the latest that the plan serves
    (`rows_plan_serves`: no row's KV chunk count differs between the two)."""
    scales = (0.05, 0.03) if kv == "fp8" else (1.0, 1.0)
    backend = flashinfer_backend(KV_DTYPES[kv])
    backend.bound_sequence_pages(256)
    expected, served = 2400, 0
    case = PagedCase([1500], [16], [16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                     dtype=torch.bfloat16, scales=scales, seed=3)
    layer, table = case.layer, case.tables[0].array
    scratch = case.kv.scratch_page
    verify, decode = LoneRung(backend, layer, 16, scratch), LoneRung(backend, layer, 1, scratch)
    for latest in (1500, 1420, 40):
        step = BatchLayout.for_tokens([16], [latest + 16], [table], 16, causal=True, expected_kv_len=expected)
        for start in range(max(latest - 15, 1), latest + 1):
            if not backend.rows_plan_serves(verify.slot, 16, (start + 16, latest + 16), expected, 16):
                continue
            served += 1
            rows = verify.run(step, case.q, case.new_k, case.new_v, kv_len=start + 16)
            for j in range(16):
                one = BatchLayout.for_tokens([1], [start + j + 1], [table], 16, causal=True, expected_kv_len=expected)
                row = decode.run(one, case.q[j:j + 1], case.new_k[j:j + 1], case.new_v[j:j + 1])
                assert torch.equal(row[0], rows[j]), f"latest {latest}, start {start}, position {start + j}"
    assert served > 20


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_a_lone_trees_node_rows_have_the_bits_of_the_decodes_along_each_path(kv):
    """A lone request's token tree of 16 rows (random parents), replayed from a node-rows rung captured once on a
    dummy, or run eagerly where a KV chunk boundary falls inside the tree (the rung declines it): every node's row
    has the bits of the decode at the node's position after its path (its ancestors' K/V at the positions before
    it), and the rows attend as the torch reference does the tree under its masks."""
    scales = (0.05, 0.03) if kv == "fp8" else (1.0, 1.0)
    backend = flashinfer_backend(KV_DTYPES[kv])
    backend.bound_sequence_pages(256)
    spare = backend.spare_pages_wanted(16)
    expected = 2400  # KV chunks of 2416 / 16 tokens in up to 8: 19 pages (304 tokens) on 132 SMs
    g = torch.Generator().manual_seed(0)
    cases = {h: PagedCase([h], [16], [16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                          dtype=torch.bfloat16, scales=scales, seed=h, spare_pages=spare) for h in (30, 295, 1500, 1510)}
    layer, scratch = cases[30].layer, cases[30].kv.scratch_page  # the graphs' cache: each case's copied in
    backend.use_spare_pages(cases[30].kv.spare_page_ids)
    tree, decode = LoneRung(backend, layer, 16, scratch, tree=True), LoneRung(backend, layer, 1, scratch)
    eager = []
    for history, case in cases.items():
        parents = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 16)]
        paths = [[0]]
        for i in range(1, 16):
            paths.append(paths[parents[i]] + [i])
        masks = torch.zeros(16, 16, dtype=torch.bool)
        for i, path in enumerate(paths):
            masks[i, path] = True
        masks = masks.cuda()
        layer.data.copy_(case.layer.data)
        table = case.tables[0].array
        step = BatchLayout.for_tokens([16], [history + 16], [table], 16, causal=True, expected_kv_len=expected)
        step = step.with_query_masks(masks[None])
        if backend.graph_fits(tree.slot, lambda: step.kv_lens, expected):
            rows = tree.run(step, case.q, case.new_k, case.new_v)
        else:
            eager.append(history)
            backend.plan(step)
            backend.write_kv(layer, case.new_k, case.new_v)
            rows = backend.attend(case.q, layer).clone()
        reference = PagedCase([history], [16], [16], True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                              dtype=torch.bfloat16, scales=scales, seed=history)
        reference.layout = reference.layout.with_query_masks(masks[None])
        err = rel_error(rows, run(TorchBackend(HQ, HKV, D, D ** -0.5, device="cuda"), reference))
        print(f"lone tree node rows {kv} history {history}: rel err {err:.2e}")
        assert err <= REL_BOUND
        for i, path in enumerate(paths):
            layer.data.copy_(case.layer.data)
            if len(path) > 1:  # the ancestors' K/V at the positions before the node's, as decoding wrote them
                positions = torch.arange(history, history + len(path) - 1)
                pages = torch.tensor(table, device="cuda")[positions // 16]
                layer.write(pages, (positions % 16).cuda(), case.new_k[path[:-1]], case.new_v[path[:-1]])
            one = BatchLayout.for_tokens([1], [history + len(path)], [table], 16, causal=True,
                                         expected_kv_len=expected)
            row = decode.run(one, case.q[i:i + 1], case.new_k[i:i + 1], case.new_v[i:i + 1])
            assert torch.equal(row[0], rows[i]), f"history {history}, node {i} at depth {len(path) - 1}"
    if backend.split_items == 132:
        assert eager == [295, 1510]  # tokens 296-311 and 1511-1526 cross the chunk boundaries at 304 and 1520


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


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("q", [1, 4], ids=["decode", "verify"])
def test_a_one_piece_rung_plans_once_and_attends_as_the_reference_at_every_step(kv, q, monkeypatch):
    """A rung of ONE_PIECE_MIN_BATCH requests' decodes or verifies keeps each request's KV in one piece, so its plan
    depends on the query counts alone: captured once and replayed for steps of other lengths (contexts of a few
    tokens to ~1,500, pages crossed), it is planned once, and every replay attends as the torch reference does, as
    an eager plan of the same step does."""
    from attention.flashinfer_backend import ONE_PIECE_MAX_EXCESS, ONE_PIECE_MIN_BATCH

    size, scales = ONE_PIECE_MIN_BATCH, (0.05, 0.03) if kv == "fp8" else (1.0, 1.0)

    def case(seed):  # the same step for the same seed
        g = torch.Generator().manual_seed(11 + seed)
        history = torch.randint(1, 120, (size,), generator=g).tolist()
        history[seed::17] = torch.randint(600, 1500, (len(history[seed::17]),), generator=g).tolist()
        return PagedCase(history, [q] * size, [q] * size, True, page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda",
                         dtype=torch.bfloat16, scales=scales, seed=seed, num_pages=1536)

    steps = [case(seed) for seed in range(3)]
    expected = [s.expected(D ** -0.5) for s in steps]
    for step, want in zip(steps, expected):  # an eager plan of such a step: the KV in one piece too
        assert rel_error(run(flashinfer_backend(KV_DTYPES[kv]), step), want) <= REL_BOUND
    steps = [case(seed) for seed in range(3)]  # the eager runs wrote the new K/V: fresh caches for the graph
    backend = flashinfer_backend(KV_DTYPES[kv])
    plans = []
    plan_wrappers = backend._plan_wrappers
    monkeypatch.setattr(backend, "_plan_wrappers", lambda *a, **k: (plans.append(k), plan_wrappers(*a, **k)))
    scratch = steps[0].kv.scratch_page
    slot = backend.graph_slot(size, 1536, steps[0].layout)
    assert slot.one_piece and backend.one_piece(steps[0].layout)
    for (step, out), want in zip(replayed_rung(backend, slot, steps, q, scratch), expected):
        err = rel_error(out, want)
        print(f"one-piece rung {kv} q={q} longest {max(step.layout.kv_lens.tolist())}: rel err {err:.2e}")
        assert err <= REL_BOUND
    assert len(plans) == 1 and plans[0]["one_piece"]  # the first step's plan served the later ones
    # a request past the batch's mean by more than ONE_PIECE_MAX_EXCESS tokens: the rung declines the step
    assert backend.graph_fits(slot, lambda: [100] * (size - 1) + [100 + ONE_PIECE_MAX_EXCESS])
    assert not backend.graph_fits(slot, lambda: [100] * (size - 1) + [300 + ONE_PIECE_MAX_EXCESS])


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
def test_a_prompt_chunk_among_many_verifies_is_planned_with_split_kv(kv, monkeypatch):
    """A mixed step of ONE_PIECE_MIN_BATCH requests (verifies of 4 over spread contexts, a prompt chunk last) is
    planned with split-KV, unlike the same verifies alone (faster so: the module's doc), and attends as the torch
    reference does."""
    from dataclasses import replace

    from attention.flashinfer_backend import ONE_PIECE_MIN_BATCH

    g = torch.Generator().manual_seed(7)
    verifies = torch.randint(1, 1200, (ONE_PIECE_MIN_BATCH - 1,), generator=g).tolist()
    for cached, chunk in [(0, 300), (400, 200)]:
        case = PagedCase(verifies + [cached], [4] * len(verifies) + [chunk], [4] * len(verifies) + [chunk], True,
                         page_size=16, kv_dtype=KV_DTYPES[kv], device="cuda", dtype=torch.bfloat16,
                         scales=(0.05, 0.03) if kv == "fp8" else (1.0, 1.0), num_pages=4096)
        case.layout = replace(case.layout, prompts=1)
        backend = flashinfer_backend(KV_DTYPES[kv])
        plans = []
        plan_wrappers = backend._plan_wrappers
        monkeypatch.setattr(backend, "_plan_wrappers", lambda *a, **k: (plans.append(k), plan_wrappers(*a, **k)))
        err = rel_error(run(backend, case), case.expected(D ** -0.5))
        print(f"prompt chunk {chunk} over {cached} cached among {len(verifies)} verifies {kv}: rel err {err:.2e}")
        assert not plans[0]["one_piece"]
        assert backend.one_piece(replace(case.layout, prompts=0))  # the same step without its prompt: one piece
        assert err <= REL_BOUND


@pytest.mark.parametrize("history, new_kv, q_lens", [
    ([40, 300, 7, 0], [4, 4, 1, 200], [4, 4, 1, 200]),  # a prompt chunk among verifies and a decode: fa2
    ([0, 0], [700, 650], [700, 650]),  # large prefills: fa3 on Hopper
])
def test_a_plans_later_layers_kernel_calls_give_what_run_gives(history, new_kv, q_lens):
    """Eager steps (a mixed step's attention between its piecewise graphs) call the kernel of a plan's first run
    directly for its later layers (attention/planned_run.py): each layer's output equals the wrapper's own run of that
    layer, bit for bit, and the call is kept with the real FlashInfer (else the test would compare run with run)."""
    from dataclasses import replace

    cases = [PagedCase(history, new_kv, q_lens, True, page_size=16, kv_dtype=torch.bfloat16, device="cuda",
                       dtype=torch.bfloat16, seed=seed, num_pages=512) for seed in range(4)]
    backend = flashinfer_backend(torch.bfloat16)
    backend.plan(replace(cases[0].layout, prompts=1))
    outs = []
    for case in cases:
        backend.write_kv(case.layer, case.new_k, case.new_v)
        outs.append(backend.attend(case.q, case.layer))
    assert backend.planned_runs[torch.bfloat16] is not None
    wrapper = backend.wrappers[torch.bfloat16]
    for case, out in zip(cases, outs):
        assert torch.equal(out, wrapper.run(case.q, case.layer.data, out=torch.empty_like(case.q)))
    assert rel_error(outs[-1], cases[-1].expected(D ** -0.5)) <= REL_BOUND

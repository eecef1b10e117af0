"""The FlashInfer backend's bookkeeping, without a GPU: every step plans one wrapper per cache dtype, with
that dtype and its kernel choice, and each layer runs the wrapper of its own dtype. FlashInfer itself
is replaced by a recorder (its kernels are tested on the GPU: tests/gpu/test_flashinfer_backend.py)."""

import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import FP8_DTYPE, KVCache


class RecordingWrapper:
    """A paged wrapper: records its plans and runs (`paged` False: a ragged one, the tree part of token trees)."""
    instances = []
    paged = True

    def __init__(self, workspace, layout, backend="auto", **kwargs):
        self.backend, self.plans, self.lengths, self.runs, self.masks = backend, [], [], [], []
        self.buffers = kwargs
        self.planned_args, self.planned_kwargs = [], []
        RecordingWrapper.instances.append(self)

    def plan(self, *args, kv_data_type=None, seq_lens=None, max_token_per_sequence=None, max_sequence_kv=None,
             packed_custom_mask=None, causal=False, **kwargs):
        self.plans.append(kv_data_type)
        self.masks.append(packed_custom_mask)
        self.planned_args.append((args, causal))
        self.planned_kwargs.append(kwargs)
        if seq_lens is not None:
            self.lengths.append((seq_lens.tolist(), max_token_per_sequence, max_sequence_kv))

    def run(self, q, *data, out=None, return_lse=False, **scales):
        self.runs.append((data[0].dtype, sorted(scales)))
        self.inputs = data
        out = q.clone() if out is None else out.copy_(q)
        return (out, torch.zeros(q.shape[:2])) if return_lse else out


class RecordingRaggedWrapper(RecordingWrapper):
    paged = False


class KernelCallingWrapper(RecordingWrapper):
    """A recorder whose run, like FlashInfer's, ends in one call of its compiled module's kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kernel_calls = 0

        def paged_run(q, k, v, out):
            self.kernel_calls += 1
            out.copy_(q + k.float().mean() + v.float().mean())

        self._cached_module = types.SimpleNamespace(paged_run=paged_run)

    def run(self, q, data, out=None, return_lse=False, **scales):
        self.runs.append((data.dtype, sorted(scales)))
        if scales:  # FP8 layers: not through the watched kernel
            return out.copy_(q)
        k, v = data.unbind(1)
        self._cached_module.paged_run(q, k, v, out)
        return out


@pytest.fixture
def backend_class(monkeypatch):
    """FlashInferBackend imported over the recorder, and forgotten afterwards (the real one stays importable)."""
    yield from import_backend(monkeypatch, RecordingWrapper)


@pytest.fixture
def kernel_backend_class(monkeypatch):
    yield from import_backend(monkeypatch, KernelCallingWrapper)


def import_backend(monkeypatch, paged_wrapper):
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=paged_wrapper,
        BatchPrefillWithRaggedKVCacheWrapper=RecordingRaggedWrapper,
        merge_state_in_place=lambda v, s, v_other, s_other: None))
    monkeypatch.delitem(sys.modules, "attention.flashinfer_backend", raising=False)
    from attention.flashinfer_backend import FlashInferBackend

    yield FlashInferBackend
    sys.modules.pop("attention.flashinfer_backend", None)


def test_each_layer_runs_the_wrapper_of_its_dtype(backend_class):
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"),
                                kv_dtypes=(torch.bfloat16, FP8_DTYPE, FP8_DTYPE), q_dtype=torch.bfloat16)
    bf16, fp8 = paged_wrappers()[:2]  # those of steps other than several uniform ones
    assert (bf16.backend, fp8.backend) == ("auto", "fa2")
    cache = KVCache(3, 8, 4, 2, 8, (torch.bfloat16, FP8_DTYPE, FP8_DTYPE), "cpu")
    backend.plan(BatchLayout.for_tokens([3], [3], [[0]], 4, causal=True))
    assert (bf16.plans, fp8.plans) == ([torch.bfloat16], [FP8_DTYPE])
    q = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    for layer in cache.layers:
        backend.attend(q, layer)
    assert bf16.runs == [(torch.bfloat16, [])]
    assert fp8.runs == [(FP8_DTYPE, ["k_scale", "v_scale"])] * 2


def test_an_eager_plans_later_layers_call_its_kernel_without_run_until_the_next_plan(kernel_backend_class):
    """A step's first layer of each dtype goes through the wrapper's run, which shows the kernel call the plan's later
    layers then make directly (attention/planned_run.py); the next plan watches its first run again. FP8 layers,
    whose run takes their scales, always go through run; a graph plan's steps never keep a call."""
    FlashInferBackend = kernel_backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"),
                                kv_dtypes=(torch.bfloat16, FP8_DTYPE), q_dtype=torch.bfloat16)
    bf16, fp8 = paged_wrappers()[:2]
    dtypes = (torch.bfloat16,) * 3 + (FP8_DTYPE,) * 2
    cache = KVCache(len(dtypes), 8, 4, 2, 8, dtypes, "cpu")
    for layer in cache.layers:
        layer.data.copy_(torch.randn(layer.data.shape).to(layer.data.dtype))
    q = torch.randn(3, 4, 8).bfloat16()
    for step in (1, 2):
        backend.plan(BatchLayout.for_tokens([3], [3], [[0]], 4, causal=True))
        outs = [backend.attend(q, layer) for layer in cache.layers]
        assert len(bf16.runs) == step and bf16.kernel_calls == 3 * step
        assert len(fp8.runs) == 2 * step and fp8.kernel_calls == 0
        for out, layer in zip(outs[:3], cache.layers):  # each layer's own cache and output
            k, v = layer.data.unbind(1)
            assert torch.equal(out, (q + k.float().mean() + v.float().mean()).bfloat16())
    slot = backend.graph_slot(1, 16, BatchLayout.dummy(1, 3, 3, 4, 7, causal=True))
    backend.plan_graph(slot, BatchLayout.for_tokens([3], [3], [[0]], 4, causal=True), scratch_page=7)
    assert backend.planned_runs is None


def test_plans_get_the_layouts_lengths(backend_class):
    """The KV lengths and maxima FlashInfer would otherwise derive from the indptrs, as the layout has them."""
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    backend.plan(BatchLayout.for_tokens([3, 1, 2], [3, 9, 5], [[0], [1, 2, 3], [4, 5]], 4, causal=True))
    (planned,) = [w for w in RecordingWrapper.instances if w.plans]
    assert planned.lengths == [([3, 9, 5], 3, 9)]


@pytest.mark.parametrize("q_lens, kv_lens, prompts, kernel", [
    ([1], [16], 0, "auto"),  # a lone request's decode without query rows (no pages bounded): fa3, computed
    ([16], [16], 0, "auto"),  # as its verify rows are
    ([1, 1, 1], [16] * 3, 0, "fa2"),  # plain decoding of several requests: fa2, the faster kernel there
    ([16, 16, 16], [16] * 3, 0, "fa2"),  # the chain verify of several requests: fa2 too
    ([1, 16, 1], [16] * 3, 0, "fa2"),  # decodes beside verifies
    ([4, 4, 12], [16] * 3, 1, "fa2"),  # a prompt chunk arriving among verifies
    ([12], [16], 1, "fa2"),  # a lone short prompt chunk (a turn whose prefix is cached): split over the KV
    ([600], [600], 1, "auto"),  # a large prefill fills fa3's query tiles
    ([4] * 64 + [600], [16] * 64 + [600], 1, "fa2"),  # ... but not when it arrives among many requests
    ([100] * 8, [200] * 8, 8, "auto"),  # 8 prompt chunks of 100
])
def test_fa3_runs_a_lone_requests_decode_or_verify_and_large_prefills_fa2_every_other_step(
        backend_class, q_lens, kv_lens, prompts, kernel):
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    tables, first = [], 0
    for kv in kv_lens:
        tables.append(list(range(first, first + -(-kv // 4))))
        first += len(tables[-1])
    layout = BatchLayout.for_tokens(q_lens, kv_lens, tables, 4, causal=True)
    backend.plan(replace(layout, prompts=prompts))
    (planned,) = [w for w in RecordingWrapper.instances if w.plans]
    assert planned.backend == kernel


def test_a_graph_rung_picks_its_kernel_by_its_size(backend_class):
    """A lone decode padded to a rung of 4 replays that rung's graph, captured with fa2; rung 1 keeps fa3.
    The rung's wrappers exist from its construction (the graph memory estimate counts them)."""
    FlashInferBackend = backend_class  # noqa: N806

    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    decode = BatchLayout.for_tokens([1], [5], [[0, 1]], 4, causal=True)
    for size, kernel in ((1, "auto"), (4, "fa2")):
        RecordingWrapper.instances = []
        slot = backend.graph_slot(size, 16, BatchLayout.dummy(size, 1, 4, 4, 15, causal=True))
        (wrapper,) = paged_wrappers()
        backend.plan_graph(slot, decode, scratch_page=15)
        assert wrapper.backend == kernel and wrapper.plans
    lone = backend.graph_slot(1, 16, BatchLayout.dummy(1, 1, 4, 4, 15, causal=True))
    two = BatchLayout.for_tokens([1, 1], [5, 8], [[0, 1], [2, 3]], 4, causal=True)  # fa2's, on fa3's rung
    with pytest.raises(ValueError, match="cannot replay"):
        backend.plan_graph(lone, two, scratch_page=15)


def test_a_backend_of_device_lengths_runs_fa2_for_every_step_eager_or_graphed(backend_class):
    """The drafter's backend: its kernels read the KV lengths on the device, which only fa2's do; so a non-causal
    draft of one request, eager or on a rung of one, runs fa2, and a rung replays whatever layout it is given."""
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16, device_lengths=True)
    draft = BatchLayout.for_tokens([4], [9], [[0, 1, 2]], 4, causal=False)
    backend.plan(draft)
    (planned,) = [w for w in RecordingWrapper.instances if w.plans]
    assert planned.backend == "fa2"
    RecordingWrapper.instances = []
    slot = backend.graph_slot(1, 16, BatchLayout.dummy(1, 4, 4, 4, 15, causal=False))
    (wrapper,) = paged_wrappers()
    backend.plan_graph(slot, draft, scratch_page=15)
    backend.plan_graph(slot, BatchLayout.for_tokens([2], [5], [[0, 1]], 4, causal=True), scratch_page=15)
    assert wrapper.backend == "fa2" and len(wrapper.plans) == 2


def paged_wrappers() -> list[RecordingWrapper]:
    return [w for w in RecordingWrapper.instances if w.paged]


def tree_step(tree_size: int, kv_lens: list[int], page_size: int = 4) -> BatchLayout:
    tables, first = [], 0
    for kv in kv_lens:
        tables.append(list(range(first, first + -(-kv // page_size))))
        first += len(tables[-1])
    masks = torch.ones(len(kv_lens), tree_size, tree_size, dtype=torch.bool).tril()
    layout = BatchLayout.for_tokens([tree_size] * len(kv_lens), kv_lens, tables, page_size, causal=True)
    return layout.with_query_masks(masks)


def test_token_trees_plan_fa2_over_the_context_and_a_ragged_tree_part_with_their_masks(backend_class):
    """A tree step: the paged fa2 wrappers planned over each request's KV before the step, in no causal order,
    and the ragged wrappers over the step's rows with the packed masks; every layer runs both."""
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    plain, several = paged_wrappers()
    (ragged,) = [w for w in RecordingWrapper.instances if not w.paged]
    assert (plain.backend, several.backend, ragged.backend) == ("auto", "fa2", "fa2")
    layout = tree_step(3, [7, 12])  # contexts of 4 and 9 tokens: 1 and 3 pages
    backend.plan(layout)
    assert several.plans and not plain.plans and ragged.masks[-1] is not None
    (qo_indptr, kv_indptr, kv_indices, last_page_len, *_), causal = several.planned_args[-1]
    assert not causal and qo_indptr.tolist() == [0, 3, 6] and kv_indptr.tolist() == [0, 1, 4]
    assert kv_indices.tolist() == [0, 2, 3, 4] and last_page_len.tolist() == [4, 1]
    assert several.lengths[-1] == ([4, 9], 3, 9)
    (tree_qo, tree_kv, *_), _ = ragged.planned_args[-1]
    assert tree_qo.tolist() == tree_kv.tolist() == [0, 3, 6]
    # the step's own page metadata stays what its write slots and K/V moves read
    assert backend.kv_indptr.tolist() == [0, 2, 5] and backend.write_pages.tolist() == [1, 1, 1, 4, 4, 4]
    layer = KVCache(1, 8, 4, 2, 8, torch.bfloat16, "cpu").layers[0]
    k, v = torch.randn(2, 6, 2, 8).bfloat16()
    backend.write_kv(layer, k, v)
    backend.attend(torch.zeros(6, 4, 8, dtype=torch.bfloat16), layer)
    assert len(several.runs) == len(ragged.runs) == 1
    assert ragged.inputs[0].data_ptr() == k.data_ptr()  # the step's rows as written, not read back
    backend.plan(layout)  # a plan forgets the last write: the rows are read from the cache, as stored
    backend.attend(torch.zeros(6, 4, 8, dtype=torch.bfloat16), layer)
    assert torch.equal(ragged.inputs[0], k) and ragged.inputs[0].data_ptr() != k.data_ptr()
    backend.plan(layout.__class__.for_tokens([3], [7], [[0, 1]], 4, causal=True))
    assert backend.tree_wrappers is None and len(ragged.plans) == 2  # the two tree steps only


def test_a_tree_rung_keeps_the_steps_page_metadata_apart_from_the_contexts(backend_class):
    """A token-tree graph rung plans its paged wrappers over buffers of their own (the context's pages), while
    the rung's kv_indptr / kv_indices get the step's (the captured graph's write slots read them)."""
    FlashInferBackend = backend_class  # noqa: N806

    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    RecordingWrapper.instances = []
    slot = backend.graph_slot(4, 16, tree_step(3, [3] * 4))
    (paged,) = paged_wrappers()
    (ragged,) = [w for w in RecordingWrapper.instances if not w.paged]
    assert paged.backend == ragged.backend == "fa2" and slot.tree_size == 3
    assert paged.buffers["paged_kv_indices_buf"] is not slot.kv_indices
    assert len(ragged.buffers["custom_mask_buf"]) == 4 * 3 * 3
    backend.plan_graph(slot, tree_step(3, [7, 12]), scratch_page=15)
    assert slot.kv_indptr.tolist()[:3] == [0, 2, 5] and slot.kv_indices.tolist()[:5] == [0, 1, 2, 3, 4]
    assert paged.buffers["paged_kv_indices_buf"].tolist()[:4] == [0, 2, 3, 4]
    (_, kv_indptr, *_), causal = paged.planned_args[-1]
    assert not causal and kv_indptr.tolist() == [0, 1, 4, 5, 6]  # the padding keeps one slot of the scratch page
    # the tree part's plan depends only on the tree size: a later step of that size writes just its masks
    other = tree_step(3, [9, 5])
    masks = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(0)) < 0.5
    other = other.with_query_masks(masks)
    backend.plan_graph(slot, other, scratch_page=15)
    assert len(ragged.plans) == 1 and len(paged.plans) == 2
    assert torch.equal(slot.tree_masks, other.padded(4, 15).packed_tree_masks())
    backend.plan_graph(slot, tree_step(2, [9, 5]), scratch_page=15)  # another size: planned again
    assert len(ragged.plans) == 2
    with pytest.raises(ValueError, match="exceeds"):
        backend.plan_graph(slot, tree_step(4, [7]), scratch_page=15)
    with pytest.raises(ValueError, match="cannot replay"):
        backend.plan_graph(slot, BatchLayout.for_tokens([3], [7], [[0, 1]], 4, causal=True), scratch_page=15)


def test_query_masks_must_fit_the_layout():
    layout = BatchLayout.for_tokens([3, 2], [7, 5], [[0, 1], [2, 3]], 4, causal=True)
    with pytest.raises(ValueError, match="of shape"):
        layout.with_query_masks(torch.ones(2, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool mask"):
        layout.with_query_masks(torch.ones(2, 3, 3))
    with pytest.raises(ValueError, match="causal"):
        causal_free = BatchLayout.for_tokens([3], [7], [[0, 1]], 4, causal=False)
        causal_free.with_query_masks(torch.ones(1, 3, 3, dtype=torch.bool))


def test_packed_tree_masks_are_what_flashinfer_reads():
    """FlashInfer, handed packed bits for the tree part (each request's n new rows against its n new rows),
    starts request i at byte i * n * n (its mask indptr from the lengths) and reads bit (row * n + col) from
    there, little bit order: read that way, every request's bits are its mask."""
    import numpy as np

    generator = torch.Generator().manual_seed(0)
    for n in (3, 4):  # 9 bits a request (padded), 16 (whole bytes)
        masks = torch.rand(3, n, n, generator=generator) < 0.5
        layout = BatchLayout.for_tokens([n] * 3, [n + 7, n, n + 12], [[0, 1, 2], [3], [4, 5, 6, 7]], 4, causal=True)
        packed = layout.with_query_masks(masks).packed_tree_masks().numpy()
        assert len(packed) == 3 * n * n
        for i in range(3):
            bits = np.unpackbits(packed[i * n * n:i * n * n + -(-n * n // 8)], bitorder="little")[:n * n]
            np.testing.assert_array_equal(bits.reshape(n, n).astype(bool), masks[i].numpy())


def test_a_tree_steps_context_is_each_requests_kv_before_its_new_rows():
    layout = tree_step(3, [7, 12, 3])  # the last has no context: one slot of its first page is kept
    context = layout.tree_context()
    assert context.kv_lens.tolist() == [4, 9, 1] and context.q_lens.tolist() == [3, 3, 3] and not context.causal
    assert context.kv_indices.tolist() == [0, 2, 3, 4, 5] and context.kv_indptr().tolist() == [0, 1, 4, 5]


def rows_backend(backend_class):
    """A backend as on a GPU whose split-KV wave holds 132 work items per KV head pair, lone rows enabled."""
    backend = backend_class(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                            q_dtype=torch.bfloat16)
    backend.split_items = 132
    backend.bound_sequence_pages(64)
    return backend


def test_a_lone_requests_decode_and_verify_plan_its_query_rows(backend_class):
    """A lone request's verify of 3 is planned as 3 requests of one query (each over its KV up to its own position),
    with one request without queries spanning two KV chunks, and a fixed chunk size from the request's expected
    length; a decode at one of those positions gets that row's plan, with the same chunk size."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    several = paged_wrappers()[1]
    assert several.backend == "fa2"
    table = list(range(8))
    # expected 20 tokens + 16: 9 pages in 132 // 16 = 8 chunks of 2 pages
    backend.plan(BatchLayout.for_tokens([3], [13], [table], 4, causal=True, expected_kv_len=20))
    (qo_indptr, kv_indptr, kv_indices, last_page_len, *_), causal = several.planned_args[-1]
    assert not causal and qo_indptr.tolist() == [0, 1, 2, 3, 3]
    assert several.lengths[-1] == ([11, 12, 13, 16], 1, 16)
    assert kv_indices.tolist() == [0, 1, 2] + [0, 1, 2] + [0, 1, 2, 3] + [0] * 4
    assert kv_indptr.tolist() == [0, 3, 6, 10, 14] and last_page_len.tolist() == [3, 4, 1, 4]
    assert several.planned_kwargs[-1]["fixed_split_size"] == 2
    # the step's own page metadata and write slots stay the request's
    assert backend.kv_indptr.tolist() == [0, 4] and backend.write_pages.tolist() == [2, 2, 3]
    backend.plan(BatchLayout.for_tokens([1], [12], [table], 4, causal=True, expected_kv_len=20))
    (qo_indptr, kv_indptr, kv_indices, *_), _ = several.planned_args[-1]
    assert qo_indptr.tolist() == [0, 1, 1] and several.lengths[-1] == ([12, 16], 1, 16)
    assert kv_indices.tolist() == [0, 1, 2] + [0] * 4 and several.planned_kwargs[-1]["fixed_split_size"] == 2
    # several requests, or a prompt chunk, keep their usual plans
    backend.plan(BatchLayout.for_tokens([1, 1], [12, 5], [table, [9, 10]], 4, causal=True))
    assert several.planned_kwargs[-1].get("fixed_split_size") is None


def test_a_verify_past_a_requests_expected_length_keeps_its_decodes_kv_chunks(backend_class):
    """Near the end of a request a verify's rows run past its expected length (the most it can hold); its rows within
    that length must get the bits of the decodes there, so its KV chunks stay the request's: expected 16 tokens + 16
    are 8 pages, one chunk of 1 page each, for the decode at 16 and for a verify over 17 and 18 tokens alike (not
    18 + 16 tokens' 9 pages, chunks of 2)."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    several = paged_wrappers()[1]
    table = list(range(8))
    for q, length in ((1, 15), (1, 16), (3, 18), (16, 31)):
        backend.plan(BatchLayout.for_tokens([q], [length], [table], 4, causal=True, expected_kv_len=16))
        assert several.planned_kwargs[-1]["fixed_split_size"] == 1, (q, length)
    # a request of unknown length: its current length's
    backend.plan(BatchLayout.for_tokens([3], [18], [table], 4, causal=True))
    assert several.planned_kwargs[-1]["fixed_split_size"] == 2


def test_every_step_of_a_lone_request_of_known_length_has_the_same_kv_chunks(backend_class):
    """Whatever a request's length at most, its decodes and its verifies of up to LONE_ROWS_MAX rows (the last ones
    running past that length) get one KV chunk size, on GPUs of 2 and 3 KV heads (132 and 88 work items)."""
    module = sys.modules["attention.flashinfer_backend"]
    split_pages_for, rows_max = module.split_pages_for, module.LONE_ROWS_MAX
    for split_items in (132, 88):
        for page_size in (16, 4):
            for expected in range(1, 700):
                splits = {split_pages_for(expected, start + q, page_size, split_items)
                          for start in range(max(0, expected - 40), expected) for q in (1, 2, 5, rows_max)}
                assert len(splits) == 1, (split_items, page_size, expected, splits)


def test_a_lone_rung_plans_query_rows_into_buffers_of_their_own(backend_class):
    """The batch-1 rung of a verify of 3 is made for 3 query rows: its wrappers read buffers sized for 4
    requests and the longest request's pages, the rung's kv_indptr / kv_indices keep the step's metadata, and
    a layout of another kind is refused."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    slot = backend.graph_slot(1, 32, BatchLayout.dummy(1, 3, 3, 4, 15, causal=True))
    (paged,) = paged_wrappers()[2:]
    assert slot.rows == 3 and paged.backend == "fa2"
    assert len(paged.buffers["qo_indptr_buf"]) == 5 and len(paged.buffers["paged_kv_indices_buf"]) == 5 * 65
    backend.plan_graph(slot, BatchLayout.for_tokens([3], [13], [list(range(8))], 4, causal=True,
                                                    expected_kv_len=20), scratch_page=15)
    assert slot.kv_indptr.tolist() == [0, 4] and slot.kv_indices.tolist()[:4] == [0, 1, 2, 3]
    assert paged.buffers["paged_kv_indices_buf"].tolist()[:14] == [0, 1, 2] * 2 + [0, 1, 2, 3] + [15] * 4
    assert paged.planned_kwargs[-1]["uniform_q_len"] is None and paged.planned_kwargs[-1]["fixed_split_size"] == 2
    with pytest.raises(ValueError, match="3 query rows"):
        backend.plan_graph(slot, BatchLayout.for_tokens([2], [13], [list(range(8))], 4, causal=True), 15)


def test_a_lone_rung_keeps_its_plan_while_each_rows_kv_chunks_are_the_same(backend_class):
    """A query-rows rung replans only when a row's number of KV chunks changes: a step whose rows have the chunks
    of the last plan (their lengths differ) writes its page metadata into the rung's buffers and keeps the plan;
    a step where a row's KV reaches a further chunk is planned anew."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    slot = backend.graph_slot(1, 32, BatchLayout.dummy(1, 3, 3, 4, 15, causal=True))
    (paged,) = paged_wrappers()[2:]

    def plan(length: int) -> None:
        step = BatchLayout.for_tokens([3], [length], [list(range(8))], 4, causal=True, expected_kv_len=20)
        backend.plan_graph(slot, step, scratch_page=15)

    plan(13)  # rows over 11, 12, 13 tokens: 3, 3, 4 pages in chunks of 2 pages, 2 each; the padding request 2
    assert len(paged.plans) == 1 and paged.planned_kwargs[-1]["fixed_split_size"] == 2
    plan(14)  # 12, 13, 14 tokens: 3, 4, 4 pages, still 2 chunks each
    assert len(paged.plans) == 1
    assert paged.buffers["qo_indptr_buf"].tolist() == [0, 1, 2, 3, 3]
    assert paged.buffers["paged_kv_indptr_buf"].tolist() == [0, 3, 7, 11, 15]
    assert paged.buffers["paged_kv_last_page_len_buf"].tolist() == [4, 1, 2, 4]
    assert paged.buffers["paged_kv_indices_buf"].tolist()[:15] == [0, 1, 2] + [0, 1, 2, 3] * 2 + [15] * 4
    plan(17)  # 15, 16, 17 tokens: the last row's 5 pages are 3 chunks
    assert len(paged.plans) == 2
    assert paged.planned_args[-1][0][1].tolist() == [0, 4, 8, 13, 17]


def test_a_lone_rung_planned_for_a_longer_step_takes_the_real_lengths_page_metadata_on_the_device(backend_class):
    """A verify queued before its length is known: the query-rows rung planned at the longest length the step may
    have serves the shorter ones whose rows have the same KV chunks (`rows_plan_serves`), and the real length on the
    device turns the planned page metadata into exactly what a plan of that length stages (`use_device_rows`)."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    q, page, pages = 3, 4, list(range(40, 72))
    slot = backend.graph_slot(1, 32, BatchLayout.dummy(1, q, q, page, 15, causal=True))
    (paged,) = paged_wrappers()[2:]

    def step(length: int) -> BatchLayout:
        return BatchLayout.for_tokens([q], [length], [pages], page, causal=True, expected_kv_len=100)

    def metadata() -> tuple[list, list, list]:
        kv_indptr, kv_indices, last_page_len = slot.planned
        used = int(kv_indptr[-1])
        return kv_indptr.tolist(), last_page_len.tolist(), kv_indices[:used].tolist()

    served = 0
    for longest in range(q + 1, 110):
        for shortest in range(max(q + 1, longest - 15), longest + 1):
            if not backend.rows_plan_serves(slot, q, (shortest, longest), 100, page):
                continue
            served += 1
            backend.plan_graph(slot, step(shortest), scratch_page=15)
            want, plans = metadata(), len(paged.plans)
            backend.plan_graph(slot, step(longest), scratch_page=15)
            backend.use_device_rows(torch.tensor([shortest]))
            assert metadata() == want, (shortest, longest)
            assert len(paged.plans) == plans  # the same plan serves both
    assert served > 500
    # rows that would cross a KV chunk boundary between the two lengths are not served (here: a row's 13th page)
    assert not backend.rows_plan_serves(slot, q, (47, 49), 100, page)
    assert not backend.rows_plan_serves(slot, 2, (47, 48), 100, page)  # a rung of other rows


def test_a_lone_tree_rung_keeps_its_context_plan_while_its_kv_chunks_are_the_same(backend_class):
    """A lone request's tree context is planned in KV chunks of its query rows' size, at least two of them (FlashInfer
    merges only then, as the captured graph does): its rung keeps the plan while the chunk count holds and plans
    again when it changes; a context of one page gets FlashInfer's own chunks. Packed masks made with the trees are
    what the tree part gets."""
    RecordingWrapper.instances = []
    backend = rows_backend(backend_class)
    slot = backend.graph_slot(1, 32, tree_step(3, [3]))
    (paged,) = paged_wrappers()[2:]
    ragged = [w for w in RecordingWrapper.instances if not w.paged][-1]  # the rung's (the backend's eager one first)

    def plan(length: int, packed: torch.Tensor | None = None) -> BatchLayout:
        step = tree_step(3, [length])
        step = replace(step, expected_kv_len=20, packed_masks=packed)
        backend.plan_graph(slot, step, scratch_page=15)
        return step

    plan(6)  # a context of 3 tokens: one page, FlashInfer's chunks
    assert len(paged.plans) == 1 and paged.planned_kwargs[-1]["fixed_split_size"] is None
    plan(12)  # 9 tokens, 3 pages: chunks of 2 pages (20 + 16 tokens in 132 // 16 chunks), 2 of them
    assert len(paged.plans) == 2 and paged.planned_kwargs[-1]["fixed_split_size"] == 2
    plan(14)  # 11 tokens, still 3 pages
    assert len(paged.plans) == 2
    assert paged.buffers["paged_kv_indptr_buf"].tolist()[:2] == [0, 3]
    assert paged.buffers["paged_kv_last_page_len_buf"].tolist()[:1] == [3]
    plan(16)  # 13 tokens, 4 pages: still 2 chunks
    assert len(paged.plans) == 2
    plan(20)  # 17 tokens, 5 pages: 3 chunks
    assert len(paged.plans) == 3
    packed = torch.arange(9, dtype=torch.uint8)
    plan(21, packed)
    assert len(ragged.plans) == 1 and torch.equal(slot.tree_masks, packed)
    # a tree whose query tiles (600 rows x 2 heads per KV head, 19 tiles of 64) times up to 9 chunks could exceed the
    # 132 work items of a graph's plan keeps FlashInfer's own chunks; 400 rows (13 tiles) still fit
    assert backend.tree_split_pages(replace(tree_step(600, [700]), expected_kv_len=700)) is None
    assert backend.tree_split_pages(replace(tree_step(400, [700]), expected_kv_len=700)) is not None


def test_a_sliding_window_keeps_a_lone_requests_usual_plan(backend_class):
    """With a sliding window a lone request's step is not split into query rows (each row would need the window of
    its own position): it keeps the kernel it had."""
    RecordingWrapper.instances = []
    backend = backend_class(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                            q_dtype=torch.bfloat16, window_left=8)
    backend.split_items = 132
    backend.bound_sequence_pages(64)
    layout = BatchLayout.for_tokens([3], [13], [list(range(8))], 4, causal=True, expected_kv_len=20)
    assert not backend.lone_rows(layout)
    backend.plan(layout)
    (planned,) = [w for w in RecordingWrapper.instances if w.plans]
    assert planned.backend == "auto" and planned.planned_kwargs[-1].get("fixed_split_size") is None


def node_rows_backend(backend_class, kv_pages: int = 16):
    """A rows backend (`rows_backend`) whose cache holds node pages: lone trees of up to 16 rows run as node rows."""
    backend = rows_backend(backend_class)
    wanted = backend.spare_pages_wanted(4)
    assert wanted == 16 * 5  # a node's context tail (up to 3 tokens) and path (up to 16): 5 pages of 4
    cache = KVCache(1, kv_pages, 4, 2, 8, torch.bfloat16, "cpu", spare_pages=wanted)
    backend.use_spare_pages(cache.spare_page_ids)
    return backend, cache


def branching_tree_step(length: int) -> BatchLayout:
    """A lone tree of 3 rows (the anchor, its child and a second child of the anchor) ending at `length` tokens."""
    masks = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = BatchLayout.for_tokens([3], [length], [list(range(8))], 4, causal=True, expected_kv_len=20)
    return layout.with_query_masks(masks[None])


def test_a_lone_small_tree_plans_each_node_as_a_query_row_over_pages_of_its_own(backend_class):
    """An eager step of a lone tree: one request per node, each over the context's full pages and then its node pages
    up to its own position (depths read back from the masks), in the query rows' KV chunks; no tree part, and every
    layer first copies the context's tail and each node's path into the node pages."""
    RecordingWrapper.instances = []
    backend, cache = node_rows_backend(backend_class)
    several = paged_wrappers()[1]
    ragged = [w for w in RecordingWrapper.instances if not w.paged]
    backend.plan(branching_tree_step(13))  # a context of 10 tokens: 2 full pages, then 2 tokens in the third
    (qo_indptr, kv_indptr, kv_indices, last_page_len, *_), causal = several.planned_args[-1]
    assert not causal and qo_indptr.tolist() == [0, 1, 2, 3, 3]
    assert several.lengths[-1] == ([11, 12, 12, 16], 1, 16)  # the anchor, its two children, the padding request
    nodes = backend.node_pages_host
    assert kv_indices.tolist() == [0, 1, nodes[0, 0], 0, 1, nodes[1, 0], 0, 1, nodes[2, 0]] + [0] * 4
    assert last_page_len.tolist() == [3, 4, 4, 4]
    assert several.planned_kwargs[-1]["fixed_split_size"] == 2 and backend.tree_wrappers is None
    layer = cache.layers[0]
    layer.data.copy_(torch.randn(layer.data.shape))
    k, v = torch.randn(2, 3, 2, 8).bfloat16()
    backend.write_kv(layer, k, v)  # the anchor and the two nodes at positions 10, 11, 12 (page 2, offsets 2, 3; page 3)
    backend.attend(torch.zeros(3, 4, 8, dtype=torch.bfloat16), layer)
    assert len(several.runs) == 1 and not any(w.runs for w in ragged)
    # node 2 (the anchor's second child, stored at position 12) sees the context's tail and the anchor, then itself
    own = layer.data[nodes[2, 0]]
    assert torch.equal(own[0, :2], layer.data[2, 0, :2]) and torch.equal(own[0, 2], k[0])
    assert torch.equal(own[0, 3], k[2]) and torch.equal(own[1, 3], v[2])


def test_a_lone_tree_rung_plans_the_deepest_node_and_the_step_makes_each_nodes_own(backend_class):
    """A graph rung of a lone tree plans every node at the deepest node's length (the tree's shape is on the device
    only); the step writes each node's real page metadata, the eager plan's, into the rung's buffers. A step where a KV
    chunk boundary falls inside the tree is declined (it runs eagerly)."""
    RecordingWrapper.instances = []
    backend, cache = node_rows_backend(backend_class)
    slot = backend.graph_slot(1, 32, tree_step(3, [3]))
    (paged,) = paged_wrappers()[2:]
    assert slot.node_rows and slot.rows == 3 and not slot.tree and backend.fa2(tree_step(3, [3]))
    step = branching_tree_step(13)
    backend.plan_graph(slot, step, scratch_page=15)
    assert paged.lengths[-1] == ([13, 13, 13, 16], 1, 16)
    assert slot.index["context"].tolist() == [10] and torch.equal(slot.node_masks, step.query_masks[0])
    assert slot.kv_indptr.tolist() == [0, 4]  # the step's own metadata: its write slots and K/V moves read it
    backend.use_device_tree()  # what the captured step does first
    buffers = [paged.buffers[name].clone() for name in
               ("paged_kv_indptr_buf", "paged_kv_last_page_len_buf", "paged_kv_indices_buf")]
    backend.plan(step)
    (_, kv_indptr, kv_indices, last_page_len, *_), _ = paged_wrappers()[1].planned_args[-1]
    assert buffers[0].tolist() == kv_indptr.tolist() and buffers[1].tolist() == last_page_len.tolist()
    # the nodes' pages; the padding request's are the scratch page in the graph, the request's first page eagerly
    assert buffers[2].tolist()[:9] == kv_indices.tolist()[:9] and buffers[2].tolist()[9:13] == [15] * 4
    assert backend.graph_fits(slot, lambda: np.array([13]), 20)
    assert not backend.graph_fits(slot, lambda: np.array([18]), 20)  # tokens 16-18: pages 4 and 5, chunks of 2 pages
    # there a tree whose nodes form one chain (the host knows their depths) is planned at each node's own length
    chain = BatchLayout.for_tokens([3], [18], [list(range(8))], 4, causal=True, expected_kv_len=20)
    backend.plan_graph(slot, chain.with_query_masks(torch.ones(1, 3, 3, dtype=torch.bool).tril(), chain=True), 15)
    assert paged.lengths[-1] == ([16, 17, 18, 16], 1, 18)
    backend.plan_graph(slot, branching_tree_step(14), scratch_page=15)  # after the chain's plan: planned again
    backend.plan_graph(slot, branching_tree_step(13), scratch_page=15)  # the same chunks as the plan before: kept
    assert len(paged.plans) == 3
    with pytest.raises(ValueError, match="node rows"):
        backend.plan_graph(slot, BatchLayout.for_tokens([3], [13], [list(range(8))], 4, causal=True), 15)


def test_trees_of_more_rows_than_node_pages_hold_keep_the_context_and_tree_parts(backend_class):
    RecordingWrapper.instances = []
    backend, _ = node_rows_backend(backend_class, kv_pages=64)
    big = replace(tree_step(17, [40]), expected_kv_len=60)
    assert not backend.node_rows(big) and backend.node_rows(replace(tree_step(16, [40]), expected_kv_len=60))
    backend.plan(big)
    assert backend.tree_wrappers is not None and backend.node_copies is None

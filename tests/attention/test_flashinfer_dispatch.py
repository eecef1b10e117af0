"""The FlashInfer backend's bookkeeping, without a GPU: every step plans one wrapper per cache dtype, with
that dtype and its kernel choice, and each layer runs the wrapper of its own dtype. FlashInfer itself
is replaced by a recorder (its kernels are tested on the GPU: tests/gpu/test_flashinfer_backend.py)."""

import sys
import types

import pytest
import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import FP8_DTYPE, KVCache


class RecordingWrapper:
    instances = []

    def __init__(self, workspace, layout, backend="auto", **kwargs):
        self.backend, self.plans, self.lengths, self.runs = backend, [], [], []
        RecordingWrapper.instances.append(self)

    def plan(self, *args, kv_data_type=None, seq_lens=None, max_token_per_sequence=None, max_sequence_kv=None,
             **kwargs):
        self.plans.append(kv_data_type)
        self.lengths.append((seq_lens.tolist(), max_token_per_sequence, max_sequence_kv))

    def run(self, q, data, out=None, **scales):
        self.runs.append((data.dtype, sorted(scales)))
        return q if out is None else out.copy_(q)


@pytest.fixture
def backend_class(monkeypatch):
    """FlashInferBackend imported over the recorder, and forgotten afterwards (the real one stays importable)."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper))
    monkeypatch.delitem(sys.modules, "attention.flashinfer_backend", raising=False)
    from attention.flashinfer_backend import FlashInferBackend

    yield FlashInferBackend
    sys.modules.pop("attention.flashinfer_backend", None)


def test_each_layer_runs_the_wrapper_of_its_dtype(backend_class):
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"),
                                kv_dtypes=(torch.bfloat16, FP8_DTYPE, FP8_DTYPE), q_dtype=torch.bfloat16)
    bf16, fp8 = RecordingWrapper.instances[:2]  # those of steps other than several decodes
    assert (bf16.backend, fp8.backend) == ("auto", "fa2")
    cache = KVCache(3, 8, 4, 2, 8, (torch.bfloat16, FP8_DTYPE, FP8_DTYPE), "cpu")
    backend.plan(BatchLayout.for_tokens([3], [3], [[0]], 4, causal=True))
    assert (bf16.plans, fp8.plans) == ([torch.bfloat16], [FP8_DTYPE])
    q = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    for layer in cache.layers:
        backend.attend(q, layer)
    assert bf16.runs == [(torch.bfloat16, [])]
    assert fp8.runs == [(FP8_DTYPE, ["k_scale", "v_scale"])] * 2


def test_plans_get_the_layouts_lengths(backend_class):
    """The KV lengths and maxima FlashInfer would otherwise derive from the indptrs, as the layout has them."""
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    wrapper = RecordingWrapper.instances[0]
    backend.plan(BatchLayout.for_tokens([3, 1, 2], [3, 9, 5], [[0], [1, 2, 3], [4, 5]], 4, causal=True))
    assert wrapper.lengths == [([3, 9, 5], 3, 9)]


@pytest.mark.parametrize("q_lens, causal, kernel", [
    ([1], True, "auto"),  # a lone request's decode: fa3, computed as its verify rows are
    ([16], True, "auto"),  # a verify
    ([1, 1, 1], True, "fa2"),  # plain decoding of several requests: fa2, the faster kernel there
    ([1, 16, 1], True, "auto"),  # a step mixing decodes with verifies or prompt chunks
    ([1, 1], False, "auto"),  # not a decode step (DFlash drafting is non-causal)
])
def test_several_decodes_run_fa2_and_every_other_bf16_step_fa3(backend_class, q_lens, causal, kernel):
    FlashInferBackend = backend_class  # noqa: N806

    RecordingWrapper.instances = []
    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    n = len(q_lens)
    backend.plan(BatchLayout.for_tokens(q_lens, [16] * n, [[i * 4 + j for j in range(4)] for i in range(n)], 4,
                                        causal=causal))
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
        (wrapper,) = RecordingWrapper.instances
        backend.plan_graph(slot, decode, scratch_page=15)
        assert wrapper.backend == kernel and wrapper.plans
    verify = BatchLayout.for_tokens([4], [8], [[0, 1]], 4, causal=True)
    with pytest.raises(ValueError, match="cannot replay"):
        backend.plan_graph(slot, verify, scratch_page=15)


def test_token_tree_masks_are_refused_with_the_backend_that_runs_them(backend_class):
    import numpy as np

    FlashInferBackend = backend_class  # noqa: N806

    backend = FlashInferBackend(4, 2, 8, 8 ** -0.5, device=torch.device("cpu"), kv_dtypes=(torch.bfloat16,),
                                q_dtype=torch.bfloat16)
    layout = BatchLayout.for_tokens([3], [7], [[0, 1]], 4, causal=True).with_query_masks(np.ones((1, 3, 3), bool))
    with pytest.raises(NotImplementedError, match="attention_backend='torch'"):
        backend.plan(layout)


def test_query_masks_must_fit_the_layout():
    import numpy as np

    layout = BatchLayout.for_tokens([3, 2], [7, 5], [[0, 1], [2, 3]], 4, causal=True)
    with pytest.raises(ValueError, match="of shape"):
        layout.with_query_masks(np.ones((2, 2, 2), bool))
    with pytest.raises(ValueError, match="causal"):
        BatchLayout.for_tokens([3], [7], [[0, 1]], 4, causal=False).with_query_masks(np.ones((1, 3, 3), bool))

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
    bf16, fp8 = RecordingWrapper.instances
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
    (wrapper,) = RecordingWrapper.instances
    backend.plan(BatchLayout.for_tokens([3, 1, 2], [3, 9, 5], [[0], [1, 2, 3], [4, 5]], 4, causal=True))
    assert wrapper.lengths == [([3, 9, 5], 3, 9)]

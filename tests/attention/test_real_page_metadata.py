"""Page metadata planned for upper bounds of the KV lengths, rewritten for the real lengths (drafting ahead)."""

import numpy as np
import pytest
import torch

from attention.batch_layout import BatchLayout, real_page_metadata


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_real_metadata_equals_the_layout_of_the_real_lengths(page_size, seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 7))
    real = rng.integers(1, 60, size=batch)
    upper = real + rng.integers(0, 33, size=batch)
    pages = [rng.permutation(500)[:-(-int(u) // page_size)] for u in upper]  # every request's pages, in order
    planned = BatchLayout.build([1] * batch, upper, [1] * batch, pages, page_size, causal=False)
    exact = BatchLayout.build([1] * batch, real, [1] * batch, pages, page_size, causal=False)
    room = len(planned.kv_indices) + 5  # a graph rung's page-index buffer is longer than any step's pages
    indices = torch.zeros(room, dtype=torch.int32)
    indices[:len(planned.kv_indices)] = torch.from_numpy(planned.kv_indices)
    indptr, last, out = real_page_metadata(torch.from_numpy(planned.kv_indptr()),
                                           torch.from_numpy(planned.last_page_lens()), indices,
                                           torch.from_numpy(real + 0), page_size)
    assert indptr.dtype == last.dtype == out.dtype == torch.int32 and len(out) == room
    assert indptr.tolist() == exact.kv_indptr().tolist()
    assert last.tolist() == exact.last_page_lens().tolist()
    assert out[:len(exact.kv_indices)].tolist() == exact.kv_indices.tolist()
    assert not out[len(exact.kv_indices):].any()


def test_real_lengths_never_exceed_the_planned_ones():
    """A padding request of a graph rung keeps its planned length whatever its staged start says."""
    planned = BatchLayout.build([1, 1], [20, 5], [1, 1], [[3, 4], [9]], 16, causal=False)
    indptr, last, indices = real_page_metadata(torch.from_numpy(planned.kv_indptr()),
                                               torch.from_numpy(planned.last_page_lens()),
                                               torch.from_numpy(planned.kv_indices.copy()), torch.tensor([17, 900]), 16)
    assert indptr.tolist() == [0, 2, 3] and last.tolist() == [1, 5] and indices.tolist() == [3, 4, 9]

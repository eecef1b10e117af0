"""StagedIndices: index arrays staged on the host and sent to the device in one copy."""

import numpy as np
import pytest
import torch

from attention.transfer import ALIGN, StagedIndices


def test_arrays_are_views_of_one_tensor_each_on_an_aligned_start():
    index = StagedIndices({"indptr": 3, "last": 2, "indices": 100}, "cpu", ones=("last",))
    assert [index[name].data_ptr() for name in ("indptr", "last", "indices")] == [
        index.device_tensor.data_ptr() + 4 * start for start in (0, ALIGN, 2 * ALIGN)]
    assert index["indptr"].tolist() == [0, 0, 0] and index["last"].tolist() == [1, 1]
    assert len(index["indices"]) == 100


def test_one_send_carries_what_was_staged_and_leaves_the_rest():
    index = StagedIndices({"indptr": 3, "indices": 100}, "cpu")
    index["indices"].fill_(7)
    host = index.stage("indptr", np.array([0, 2, 5]))
    assert host.tolist() == [0, 2, 5] and index["indptr"].tolist() == [0, 0, 0]  # not sent yet
    index.stage("indices", np.arange(5))
    index.send()
    assert index["indptr"].tolist() == [0, 2, 5]
    assert index["indices"].tolist()[:6] == [0, 1, 2, 3, 4, 7]  # sent as far as staged
    index.stage("indptr", np.array([0, 1]))  # fewer values: the rest keeps what was sent
    index.send()
    assert index["indptr"].tolist() == [0, 1, 5]


def test_more_values_than_an_array_holds_are_refused():
    index = StagedIndices({"indptr": 3}, "cpu")
    with pytest.raises(ValueError, match="4 values do not fit the 3 of index buffer 'indptr'"):
        index.stage("indptr", np.arange(4))
    assert index.device_tensor.dtype == torch.int32

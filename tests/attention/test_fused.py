"""The functions a GPU step runs fused (attention/fused.py) trace whole under torch.compile (a graph break would fail
the GPU's compile and leave them unfused) and give what they give as written; a function that cannot compile runs
as written, with a warning. The CPU traces them with the compiler's eager backend: the GPU's inductor kernels are
checked by the GPU tests (tests/gpu), which run these steps fused."""

import numpy as np
import pytest
import torch

from attention.batch_layout import BatchLayout, write_node_row_metadata, write_query_row_metadata
from attention.fused import ENV_SWITCH, fused, fusing
from attention.node_rows import copy_rows, node_copy_rows
from specdec.engine.token_tree import possible_nodes
from specdec.engine.tree_speculator import accept_trees, build_trees
from tests.attention_cases import random_tree


def traced(fn):
    """`fn` through torch.compile with the fused functions' settings, on the CPU's eager backend."""
    return fused(fn, backend="aot_eager").compiled


def assert_same(want, got):
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_node_row_copies_trace_whole_and_copy_the_same_rows():
    g = torch.Generator().manual_seed(0)
    masks = random_tree(16, g)
    args = (masks, torch.tensor([37]), torch.randperm(40, generator=g).int(), torch.arange(100, 180).int().view(16, 5),
            4, 0)
    want = node_copy_rows(*args)
    assert_same(want, traced(node_copy_rows)(*args))
    _, source, destination = want
    rows = torch.randn(180 * 2 * 4, 8, generator=g)
    expected = rows.clone()
    copy_rows(expected, source, destination)
    traced(copy_rows)(rows, source, destination)
    assert torch.equal(rows, expected)
    assert not torch.equal(rows[destination], torch.zeros_like(rows[destination]))


def page_metadata(kv_lens, page_size=4):
    pages = [np.arange(100 * i, 100 * i + -(-n // page_size), dtype=np.int32) for i, n in enumerate(kv_lens)]
    layout = BatchLayout.for_tokens([1] * len(kv_lens), kv_lens, pages, page_size, causal=False)
    return [torch.from_numpy(a.astype(np.int32)) for a in (layout.kv_indptr(), layout.last_page_lens(),
                                                           layout.kv_indices)]


@pytest.mark.parametrize("write, extra", [
    (write_node_row_metadata, (torch.tensor([21]), torch.tensor([0, 1, 2, 1, 3, 2]))),
    (write_query_row_metadata, (torch.tensor([27]), 6)),
])
def test_device_page_metadata_traces_whole_and_writes_the_same(write, extra):
    planned = page_metadata([27] * 6 + [64])  # each row planned at the deepest length, then the padding request
    want = [t.clone() for t in planned]
    write(*want, *extra, 4)
    got = [t.clone() for t in planned]
    traced(write)(*got, *extra, 4)
    assert_same(want, got)
    assert not torch.equal(want[2], planned[2])  # the lengths changed the page indices


def test_tree_building_and_acceptance_trace_whole_and_give_the_same_trees():
    g = torch.Generator().manual_seed(1)
    n, k, nodes = 15, 4, 15
    logprobs, tokens = (torch.randn(1, n, 100, generator=g) * 3).log_softmax(-1).topk(k, dim=-1)
    possible = possible_nodes(n, k, nodes, torch.device("cpu"))
    want = build_trees(logprobs, tokens, nodes)
    got = traced(build_trees)(logprobs, tokens, nodes, possible=possible)
    assert_same(want, got)
    tree_tokens, parents, depths, scores, ranks, mask, _ = want
    # the target agrees along the first candidates for 3 positions, then picks the second candidate once
    chosen = torch.zeros(1, nodes + 1, dtype=torch.long)
    chosen[0, 0] = tokens[0, 0, 0]
    chosen[0, 1:] = tree_tokens[0, 0]
    args = (tree_tokens, parents, depths, scores, ranks, mask, chosen, n)
    accepted = accept_trees(*args)
    assert accepted[1].item() >= 1
    assert_same(accepted, traced(accept_trees)(*args))


def test_a_function_that_cannot_compile_runs_as_written_with_a_warning():
    def with_a_graph_break(x):
        torch._dynamo.graph_break()
        return x + 1

    run = fused(with_a_graph_break, backend="aot_eager")
    with pytest.warns(UserWarning, match="runs unfused"):
        assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert run.failed and torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))


def test_only_cuda_fuses_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # as if Triton were installed
    monkeypatch.setenv(ENV_SWITCH, "1")
    assert not fusing("cpu")
    assert fusing("cuda")
    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not fusing("cuda")

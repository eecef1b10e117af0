"""A lone request's token tree as node rows (attention/node_rows.py), against the tree's masked attention: each node
row, over the context's full pages and its node pages after the step's copies, attends as the node does in the tree
(the torch reference backend, fp32), for random trees, contexts and page layouts; and the page metadata a graph step
makes on the device from a plan for the deepest node equals the plan of each node's own length."""

import numpy as np
import pytest
import torch

from attention.batch_layout import BatchLayout, real_page_metadata
from attention.kv_cache import KVCache
from attention.node_rows import NodeRowCopies, chunks_agree, node_pages_per_row, node_rows_layout
from attention.torch_backend import TorchBackend
from tests.attention_cases import HKV, HQ, D, random_tree

PAGE = 4


def tree_case(context: int, q: int, seed: int):
    """A cache holding a context and a tree step's rows as stored, the step's layout, its node pages and queries."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 64
    pages_used = -(-(context + q) // PAGE)
    request_pages = torch.randperm(num_pages, generator=g)[:pages_used].numpy().astype(np.int32)
    per_node = node_pages_per_row(PAGE, q)
    kv = KVCache(1, num_pages, PAGE, HKV, D, torch.float32, "cpu", spare_pages=q * per_node)
    kv.layers[0].data.copy_(torch.randn(kv.layers[0].data.shape, generator=g))
    node_pages = np.asarray(kv.spare_page_ids, dtype=np.int32).reshape(q, per_node)
    step = BatchLayout.for_tokens([q], [context + q], [request_pages], PAGE, causal=True)
    masks = random_tree(q, g)
    queries = torch.randn(q, HQ, D, generator=g)
    return kv, step, node_pages, masks, queries


def attend(layout: BatchLayout, kv: KVCache, queries: torch.Tensor) -> torch.Tensor:
    backend = TorchBackend(HQ, HKV, D, D ** -0.5)
    backend.plan(layout, write_slots=False)
    return backend.attend(queries, kv.layers[0])


@pytest.mark.parametrize("context,q,seed", [(0, 5, 0), (1, 16, 1), (7, 16, 2), (8, 9, 3), (13, 3, 4), (30, 16, 5),
                                            (33, 1, 6)])
def test_each_node_row_attends_as_the_node_does_in_its_tree(context, q, seed):
    kv, step, node_pages, masks, queries = tree_case(context, q, seed)
    want = attend(step.with_query_masks(masks[None]), kv, queries)
    copies = NodeRowCopies(masks, torch.tensor([context]), torch.from_numpy(step.kv_indices),
                           torch.from_numpy(node_pages.astype(np.int64)), PAGE, parking_page := kv.scratch_page)
    before = kv.layers[0].data.clone()
    copies.copy(kv.layers[0])
    # only node pages changed (the parked copies rewrite the parking page's row with itself)
    changed = (kv.layers[0].data != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= set(node_pages.flatten().tolist()) and parking_page not in changed
    depths = (masks.sum(dim=1) - 1).numpy()
    rows = node_rows_layout(step, depths, 2, kv.scratch_page, node_pages)
    assert rows.q_lens.tolist() == [1] * q + [0] and rows.kv_lens[:q].tolist() == (context + 1 + depths).tolist()
    got = attend(rows, kv, torch.cat([queries, queries[:0]]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("context,q", [(0, 16), (5, 16), (12, 7), (29, 16)])
def test_a_plan_for_the_deepest_node_becomes_each_nodes_own_on_the_device(context, q):
    """What a graph step does: every node planned at the deepest node's length, then each node's real length from the
    masks (`real_page_metadata`), page for page the plan of each node's own length."""
    kv, step, node_pages, masks, _ = tree_case(context, q, seed=context)
    depths = (masks.sum(dim=1) - 1).numpy()
    exact = node_rows_layout(step, depths, 3, kv.scratch_page, node_pages)
    deepest = node_rows_layout(step, np.full(q, q - 1), 3, kv.scratch_page, node_pages)
    lengths = torch.cat([context + masks.sum(dim=1), torch.tensor([1 << 30])])
    indptr, last, indices = real_page_metadata(torch.from_numpy(deepest.kv_indptr()),
                                               torch.from_numpy(deepest.last_page_lens()),
                                               torch.from_numpy(deepest.kv_indices), lengths, PAGE)
    assert indptr.tolist() == exact.kv_indptr().tolist() and last.tolist() == exact.last_page_lens().tolist()
    assert indices[:len(exact.kv_indices)].tolist() == exact.kv_indices.tolist()


def test_chunks_agree_unless_a_chunk_boundary_falls_inside_the_tree():
    # pages of 4 tokens, chunks of 2 pages (8 tokens): a tree of 4 rows after 3 tokens spans tokens 4-7, one chunk
    assert chunks_agree(3, 4, 4, 2)
    assert not chunks_agree(5, 4, 4, 2)  # tokens 6-9: the shallowest node's KV is 1 chunk, the deepest's 2
    assert chunks_agree(8, 4, 4, 2)  # tokens 9-12: 2 chunks each
    assert chunks_agree(0, 1, 4, 2)

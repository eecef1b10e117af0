"""A lone request's token tree attended as one query row per node, each over a KV of its own.

A decode of position p and the verify row of the same position give the same bits when both run one query
over the same KV in the same chunks (`BatchLayout.query_rows`, the FlashInfer backend). A tree node's KV is the
context and then its path (its ancestors and itself), but the step stores the tree's nodes side by side, in
best-first order. So each node gets pages of its own ("node pages", outside the pool) that hold the context's
last partial page and its path at the offsets of their positions; its KV is the request's full pages before the
step, then its node pages. Planned as a chain's rows are (one request per node, KV chunks of the request's
fixed size, one padding request so that FlashInfer always merges chunks), every node then gets the bits a
decode of its position gets, and greedy trees reproduce greedy decoding token for token at batch 1.

    layout = node_rows_layout(step, depths, split_pages, padding_page, node_pages)   # the plan (host)
    copies = NodeRowCopies(masks, context, request_pages, node_pages, page_size, scratch_page)  # per step (device)
    copies.copy(layer)                      # per layer, after the step's K/V are written: a gather and a scatter

The tree's shape exists only on the device (built inside a CUDA graph), so a graph step plans every node for
the deepest node's length and writes each node's real page metadata on the device
(`attention.batch_layout.real_page_metadata`). FlashInfer derives its work items from each request's number
of KV chunks, so that plan holds only while every node has as many chunks as the deepest one
(`chunks_agree`). Elsewhere a graph step takes a tree whose nodes form a chain (their depths known on the host),
and an eager step reads the depths back and plans each node's own length.
"""

from __future__ import annotations

import numpy as np
import torch

from attention.batch_layout import BatchLayout
from attention.fused import fused_if
from attention.kv_cache import LayerKV


def node_pages_per_row(page_size: int, rows: int) -> int:
    """Pages of its own a node of a tree of `rows` rows needs: the context's last partial page (up to page_size - 1
    tokens) and a path of up to `rows` tokens."""
    return -(-(page_size - 1 + rows) // page_size)


def chunks_agree(context: int, rows: int, page_size: int, split_pages: int) -> bool:
    """Whether every node of a tree of `rows` rows after `context` tokens has as many KV chunks of `split_pages`
    pages as the deepest possible node (a plan for the deepest node's length then serves them all)."""
    shallowest, deepest = -(-(context + 1) // page_size), -(-(context + rows) // page_size)
    return -(-shallowest // split_pages) == -(-deepest // split_pages)


def node_rows_layout(step: BatchLayout, depths: np.ndarray, split_pages: int, padding_page: int,
                     node_pages: np.ndarray) -> BatchLayout:
    """A lone request's tree step (`step`: its q rows, the anchor and its nodes, written after its context) as one
    request per node, in no causal order: node i (depth `depths[i]`, the anchor 0) sees the context's full pages,
    then its node pages `node_pages[i]`, up to its own position; then one request with no query whose KV
    (`padding_page` 2 x `split_pages` times) spans two KV chunks, as `BatchLayout.query_rows` has it."""
    q, page_size = int(step.q_lens[0]), step.page_size
    context = int(step.kv_lens[0]) - q
    full = context // page_size
    lens = (context + 1 + np.asarray(depths)).astype(np.int32)
    own = -(-(lens - full * page_size) // page_size)
    indices = np.concatenate([np.concatenate([step.kv_indices[:full], node_pages[i, :n]])
                              for i, n in enumerate(own.tolist())]
                             + [np.full(2 * split_pages, padding_page, dtype=np.int32)])
    return BatchLayout(np.append(np.ones(q, np.int32), 0).astype(np.int32),
                       np.append(lens, 2 * split_pages * page_size).astype(np.int32),
                       np.zeros(q + 1, np.int32), indices.astype(np.int32), page_size, causal=False)


class NodeRowCopies:
    """The rows a tree step copies into its nodes' pages, from the tree's masks on the device: for node i, the
    context's last partial page and then the node's path (anchor first), each at the offset of its position.
    Tensor operations of fixed shapes only (no host sync: a CUDA graph captures them). `context`: the tokens
    before the step (a device tensor of one element); `request_pages`: the request's pages (the step's page
    metadata); `node_pages` [q or more, pages per node]; rows a node does not use copy the scratch page's first
    row onto itself. `fuse`: their small kernels compiled into a few (`attention.fused`; fixed shapes only)."""

    def __init__(self, masks: torch.Tensor, context: torch.Tensor, request_pages: torch.Tensor,
                 node_pages: torch.Tensor, page_size: int, scratch_page: int, fuse: bool = False):
        slots = fused_if(node_copy_rows, fuse)
        self.depths, self.source_rows, self.destination_rows = slots(masks, context, request_pages, node_pages,
                                                                     page_size, scratch_page)
        self._copy_rows = fused_if(copy_rows, fuse)

    def copy(self, layer: LayerKV) -> None:
        """The rows into the node pages of one layer, as stored (after the step's K/V are written there)."""
        self._copy_rows(layer.rows(), self.source_rows, self.destination_rows)


def node_copy_rows(masks: torch.Tensor, context: torch.Tensor, request_pages: torch.Tensor, node_pages: torch.Tensor,
                   page_size: int, scratch_page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`NodeRowCopies`' nodes' depths [q], and the `LayerKV.rows()` each layer copies from and to."""
    q, device = masks.shape[0], masks.device
    depths = masks.sum(dim=1) - 1  # [q]: a node sees itself and one ancestor per depth
    nodes = torch.arange(q, device=device)
    # ancestors[i, d]: node i's ancestor at depth d (itself at its own depth); past its depth, column q
    columns = torch.where(masks, depths[None, :], q)
    ancestors = torch.zeros(q, q + 1, dtype=torch.long, device=device).scatter_(1, columns, nodes.expand(q, q))
    width = page_size - 1 + q  # a node's rows: the context's last partial page, then its path
    row = torch.arange(width, device=device)
    context = context.reshape(1).long()
    tail = context % page_size
    step_in_path = (row - tail)[None, :]  # [1, width]: the depth a row holds (< 0: a context row)
    used = step_in_path <= depths[:, None]
    path_node = ancestors.gather(1, step_in_path.clamp(0, q - 1).expand(q, width))
    position = torch.where(step_in_path < 0, context - tail + row[None, :], context + path_node)
    source = request_pages[position // page_size].long() * page_size + position % page_size
    destination = node_pages[:q, row // page_size].long() * page_size + row % page_size
    parked = torch.full_like(source, scratch_page * page_size)
    source_slots = torch.where(used, source, parked).flatten()
    destination_slots = torch.where(used, destination, parked).flatten()
    return depths, LayerKV.kv_rows(source_slots, page_size), LayerKV.kv_rows(destination_slots, page_size)


def copy_rows(rows: torch.Tensor, source: torch.Tensor, destination: torch.Tensor) -> None:
    """rows[destination] = rows[source], every source read first (a gather and a scatter; one kernel fused)."""
    rows.index_copy_(0, destination, rows.index_select(0, source))

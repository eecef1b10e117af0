"""The attention backend interface: planned once per forward step, then run by every layer.

    backend.plan(layout)            # once per step: metadata for the whole batch
    for layer in layers:
        backend.write_kv(cache.layers[i], k, v)   # this step's new K/V into their slots
        out = backend.attend(q, cache.layers[i])  # paged attention over each request's KV

After `plan`, `kv_indices` / `kv_indptr` hold the step's page metadata on the device, so a step can
compute its own write slots there (`set_write_slots`, used by fixed-shape steps and CUDA graphs).
Backends with `supports_graphs` also have `graph_slot(batch_size, max_pages, example)` and
`plan_graph(slot, layout, scratch_page)`: the capture / replay hooks (see specdec/runtime/cuda_graphs.py).

Implementations are chosen by name through the registry in `attention/__init__.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import LayerKV


class AttentionBackend(ABC):
    supports_graphs = False
    plans_upper_bounds = False  # whether a graph step may be planned for upper bounds of its KV lengths

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float, window_left: int = -1):
        """window_left >= 0: a query at position p sees only the keys at p - window_left and later (a sliding
        window, as FlashInfer's `window_left`; with causal=False the step's later keys stay visible); -1: all."""
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sm_scale = sm_scale
        self.window_left = window_left
        self.layout: BatchLayout | None = None
        self.kv_indices: torch.Tensor | None = None  # [pages used] int32, the planned step's pages
        self.kv_indptr: torch.Tensor | None = None  # [batch + 1] int32
        self.write_pages: torch.Tensor | None = None  # [new K/V rows] int64
        self.write_offsets: torch.Tensor | None = None

    @abstractmethod
    def plan(self, layout: BatchLayout, write_slots: bool = True) -> None:
        """Prepare the metadata of one forward step, shared by all layers; write_slots=False when the
        step sets its own (`set_write_slots`)."""

    def set_write_slots(self, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        """(page, offset) of every K/V row the step's layers write, in the order they pass them."""
        self.write_pages, self.write_offsets = pages, offsets

    def reserve_write_rows(self, rows: int) -> None:
        """No step will write more than `rows` K/V rows: a backend may keep per-step buffers of that size (the
        FlashInfer backend's slots for its append kernel). A no-op by default."""

    def bound_sequence_pages(self, pages: int) -> None:
        """No request's KV will span more than `pages` pages: a backend may size per-request buffers by it (the
        FlashInfer backend's lone-request rows, `FlashInferBackend.lone_rows`). A no-op by default."""

    def graph_fits(self, slot, kv_lens: Callable[[], np.ndarray], expected_kv_len: int = 0) -> bool:
        """Whether graph rung `slot` runs a step of requests of the KV lengths `kv_lens()` gives (counting the step's
        new tokens) as well as a plan made for that step would: a backend may decline lengths its rung's kernels suit
        badly, and the step then runs another way. The lengths are asked for only where the rung looks at them (host
        work on every step's path); `expected_kv_len`: a lone request's length at most (`BatchLayout`). True by
        default."""
        return True

    def spare_pages_wanted(self, page_size: int) -> int:
        """KV pages of its own (outside the pool) the backend would use for token trees (`use_spare_pages`); 0 by
        default."""
        return 0

    def exact_tree_rows(self) -> int:
        """The most rows (the anchor and the nodes) of a lone request's token tree whose every node the backend
        attends with the bits of a decode at its position (the FlashInfer backend's node rows), where larger trees'
        attention only rounds like a decode's; 0: every tree it attends is as exact as its decodes (the default)."""
        return 0

    def use_spare_pages(self, pages: list[int]) -> None:
        """The pages `spare_pages_wanted` asked for, allocated with the cache (`KVCache.spare_page_ids`)."""

    def use_device_lengths(self, kv_lens: torch.Tensor) -> None:
        """The planned step's real KV lengths [batch] on the device (called by the step itself, inside its CUDA
        graph), for a step planned with upper bounds of them: its attention and write slots then read each
        request's first pages up to its real length. A no-op where plans are exact (the default)."""

    def lengths_plan_serves(self, slot) -> bool:
        """Whether graph rung `slot`'s plan, made for upper bounds of its requests' KV lengths, runs a step as well at
        the real lengths given on the device (`use_device_lengths`): a step queued before the host knows them. False
        by default (no such plans)."""
        return False

    def rows_plan_serves(self, slot, q: int, kv_lens: tuple[int, int], expected_kv_len: int, page_size: int) -> bool:
        """Whether graph rung `slot`, planned for a lone request's step of q rows at KV length kv_lens[1], runs it as
        well at every KV length from kv_lens[0] up, given that length on the device (`use_device_rows`): a step
        queued before the host knows its length. False by default (no such plans)."""
        return False

    def use_device_rows(self, kv_len: torch.Tensor) -> None:
        """The real KV length (one element, on the device, with the step's rows) of a lone request's step planned for
        a longer one (`rows_plan_serves`): its page metadata becomes the real length's. Called by the step itself,
        inside its CUDA graph, before its layers (with the planned length it leaves the metadata as it is). A no-op by
        default."""

    def use_device_tree(self) -> None:
        """The planned token-tree step's node metadata from its masks on the device (called by the step itself,
        inside its CUDA graph, before its layers), where the backend plans a tree's shape it does not know on the
        host (the FlashInfer backend's node rows). A no-op by default."""

    @abstractmethod
    def write_kv(self, layer: LayerKV, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [layout.num_new_kv, num_kv_heads, head_dim] -> their cache slots."""

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: LayerKV, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [layout.num_queries, num_qo_heads, head_dim] -> output of the same shape (written into
        `out` when given: a piecewise CUDA graph's static buffer)."""

"""CUDA graphs of one fixed-shape step over a ladder of batch sizes, and their static inputs.

    ladder = GraphLadder("verify", sizes, attn, max_pages, dummy_layout, body, pool)
    ladder.capture()                          # at start-up, largest batch first, one shared memory pool
    rung = ladder.rung_for(batch)             # smallest captured size >= batch (None: run eagerly)
    attn.plan_graph(ladder.slot(rung), layout, scratch_page)   # host planning into the rung's buffers
    ...fill the static inputs...; ladder.replay(rung)

`body(batch_size)` is the step itself: it reads only static input buffers and the attention
backend's current page metadata, and writes its results into static output buffers, so the same
function runs eagerly (enforce_eager, or a batch above the ladder) and inside a graph.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from typing import Callable

import numpy as np
import torch

from attention.batch_layout import BatchLayout
from attention.transfer import CopyFence

# dense where batches are small (padding costs most there), then steps of 32 up to 256
DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's garbage collector held off while graphs are captured. A collection mid-capture could
    free an unreachable object's CUDA resources (another engine's pinned buffers with their recorded
    events), and CUDA forbids such calls while a stream is capturing: the capture would fail."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def ladder_sizes(max_batch: int) -> tuple[int, ...]:
    """The default rungs up to max_batch, with max_batch itself as the top rung."""
    return tuple(sorted({s for s in DEFAULT_LADDER if s < max_batch} | {max_batch}))


def captured_size_for(sizes: tuple[int, ...], graphs: dict, n: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `n`, once `graphs` are captured (None: run eagerly)."""
    if not graphs:
        return None
    return next((s for s in sizes if s >= n), None)


def gpu_seconds(run: Callable[[], object], repeats: int = 5) -> float:
    """GPU seconds of one `run()` (a graph replay), the median of `repeats`, timed with CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_max_pages(num_pages: int, max_batch: int, new_rows_per_request: int, page_size: int) -> int:
    """Page-index room a graph slot needs: every real page at most once, plus the scratch pages of
    padding requests that each write `new_rows_per_request` K/V rows."""
    return num_pages + max_batch * (-(-new_rows_per_request // page_size) + 1)


class StaticInputs:
    """Named int64 input buffers at fixed device addresses, filled on the host in a pinned mirror and sent
    with one non-blocking copy per step. A fill must not change what a queued copy still reads (`CopyFence`):
    normally that copy has long run (the step's device-to-host transfer came after it), but a second upload in
    the same step (a plain step's held drafter context, then its prompt chunks') finds the first one queued
    behind the step's forward. On CUDA there are two mirrors: a fill then writes the other one, brought up to
    date, instead of waiting for the forward."""

    def __init__(self, sizes: dict[str, int], device: torch.device):
        self.offsets, total = {}, 0
        for name, size in sizes.items():
            self.offsets[name] = (total, size)
            total += size
        cuda = device.type == "cuda"
        self.mirrors = [torch.zeros(total, dtype=torch.int64, pin_memory=cuda) for _ in range(2 if cuda else 1)]
        self.views = [mirror.numpy() for mirror in self.mirrors]
        self.fences = [CopyFence(device) for _ in self.mirrors]  # each mirror's last copy, while it may read it
        self.current = 0  # the mirror that fills write and the next upload sends
        self.device_buffer = torch.zeros(total, dtype=torch.int64, device=device)

    def __getitem__(self, name: str) -> torch.Tensor:
        start, size = self.offsets[name]
        return self.device_buffer[start:start + size]

    def fill(self, name: str, values, pad: int = 0) -> None:
        start, size = self.offsets[name]
        values = np.asarray(values, dtype=np.int64).reshape(-1)
        view = self._writable()
        view[start:start + len(values)] = values
        view[start + len(values):start + size] = pad

    def _writable(self) -> np.ndarray:
        """The current mirror, or, while a queued copy may still read it, the other one (once its own copy has run)
        holding the same values: names not filled again keep what they had."""
        if len(self.mirrors) > 1 and self.fences[self.current].busy():
            previous, self.current = self.current, 1 - self.current
            self.fences[self.current].wait()
            self.views[self.current][:] = self.views[previous]
        else:
            self.fences[self.current].wait()
        return self.views[self.current]

    def upload(self) -> None:
        self.device_buffer.copy_(self.mirrors[self.current], non_blocking=True)
        self.fences[self.current].mark()


class GraphLadder:
    def __init__(self, name: str, sizes: tuple[int, ...], attn, max_pages: int,
                 dummy_layout: Callable[[int], BatchLayout], body: Callable[[int], None], pool):
        self.name = name
        self.sizes = tuple(sorted(sizes))
        self.attn = attn
        self.max_pages = max_pages
        self.dummy_layout = dummy_layout
        self.body = body
        self.pool = pool
        self.slots: dict[int, object] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def capture(self, scratch_page: int) -> float:
        """Capture every rung, largest first (smaller ones reuse its pool memory); returns seconds."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            layout = self.dummy_layout(size)
            slot = self.attn.graph_slot(size, self.max_pages, layout)
            self.attn.plan_graph(slot, layout, scratch_page)
            self.body(size)  # warm-up outside the graph: lazy initialisations must not be captured
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.body(size)
            self.slots[size], self.graphs[size] = slot, graph
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def rung_for(self, batch: int) -> int | None:
        return captured_size_for(self.sizes, self.graphs, batch)

    def slot(self, rung: int):
        return self.slots[rung]

    def replay(self, rung: int) -> None:
        self.graphs[rung].replay()


class BatchGraphs:
    """Small tensor work of a step (a token tree's building, its acceptance) captured per batch rung, so
    that its many small kernels cost one launch. `body(size)` reads the first `size` rows of static input
    buffers and returns a tuple of tensors; a captured rung returns the tensors of its capture, which
    every replay rewrites in place (read their first `batch` rows). Without capture it runs eagerly.

    Each graph has a memory pool of its own (a few MiB): its outputs outlive the replay and are read after
    other graphs have run, and in a shared pool they could sit in memory that those graphs use as scratch."""

    def __init__(self, name: str, sizes: tuple[int, ...], body: Callable[[int], tuple[torch.Tensor, ...]]):
        self.name = name
        self.sizes = tuple(sorted(sizes))
        self.body = body
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def rung_for(self, batch: int) -> int | None:
        return captured_size_for(self.sizes, self.graphs, batch)

    def capture(self) -> float:
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self.body(size)  # warm-up outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.outputs[size] = self.body(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def replay_seconds(self, rung: int) -> float:
        """GPU seconds of one replay of the graph of `rung` (0 if not captured)."""
        graph = self.graphs.get(rung)
        return 0.0 if graph is None else gpu_seconds(graph.replay)

    def run(self, batch: int) -> tuple[torch.Tensor, ...]:
        """The outputs for the first `batch` rows (a replay of the rung that holds them, else eager)."""
        rung = self.rung_for(batch)
        if rung is None:
            return self.body(batch)
        self.graphs[rung].replay()
        return tuple(t[:batch] for t in self.outputs[rung])

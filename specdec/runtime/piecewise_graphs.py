"""CUDA graphs of a forward of any token count, cut at attention (piecewise graphs).

A step that mixes prompt chunks with decode or verify tokens has a ragged shape: its requests'
query lengths change every step, so its attention cannot be captured once for all steps. Everything
else in the forward works row by row, so it is captured for a ladder of token counts (a step's tokens
are padded up to the next captured count), cut into pieces at every layer's attention. Attention is
planned per step with the real layout and runs eagerly between the pieces, over the real rows only:

    graphs = PiecewiseGraphs("mixed", sizes, pool)
    graphs.capture(forward)          # forward(size, cut) runs the model, calling cut(gap) at each attention
    size = graphs.size_for(tokens)   # the smallest captured count >= tokens (None: run eagerly)
    graphs.replay(size, tokens)      # piece 0, gap 0, piece 1, gap 1, ..., the last piece

`forward(size, cut)` reads only static input buffers and writes its results into static buffers.
`cut(gap)` ends the current piece and starts the next; at replay `gap(tokens)` is the eager work
between the two (a layer's attention from a static query buffer into a static output buffer). The
pieces of every size share one memory pool: they replay in the order they were captured and never
overlap, so a piece may reuse what an earlier one freed.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from specdec.runtime.cuda_graphs import captured_size_for

Gap = Callable[[int], None]  # eager work between two pieces, given the step's real token count
Cut = Callable[[Gap], None]

# dense where steps are small (decode batches with a short prompt), then steps of 128 tokens up to 2048
# (a verify batch of 64 x 16 plus a prompt: padding costs compute there), coarser above
SMALL_SIZES = (8, 16, 32, 64, 128, 256)
# larger steps run eagerly: their GPU work dwarfs the host's, and their pieces' activations would hold
# GiBs of graph memory (a 32k-token step's MLP alone takes 1.2 GB on the default target)
MAX_CAPTURED_TOKENS = 8192


def token_sizes(max_tokens: int) -> tuple[int, ...]:
    """The captured token counts up to max_tokens (at most MAX_CAPTURED_TOKENS), the top one included."""
    max_tokens = min(max_tokens, MAX_CAPTURED_TOKENS)
    sizes = {*SMALL_SIZES, *range(384, 2049, 128), *range(2560, 4097, 512), *range(5120, max_tokens, 1024)}
    return tuple(sorted({s for s in sizes if s < max_tokens} | {max_tokens}))


class PiecewiseGraph:
    """The pieces of one token count and the eager gaps between them."""

    def __init__(self, pool):
        self.pool = pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.gaps: list[Gap] = []

    def begin(self) -> None:
        self.pieces.append(torch.cuda.CUDAGraph())
        self.pieces[-1].capture_begin(self.pool)

    def cut(self, gap: Gap) -> None:
        self.pieces[-1].capture_end()
        self.gaps.append(gap)
        self.begin()

    def end(self) -> None:
        self.pieces[-1].capture_end()

    def replay(self, tokens: int) -> None:
        for piece, gap in zip(self.pieces, self.gaps):
            piece.replay()
            gap(tokens)
        self.pieces[-1].replay()


def skip_gaps(gap: Gap) -> None:
    """A cut that runs nothing: warm-up and memory measurement run the pieces alone."""


class PiecewiseGraphs:
    def __init__(self, name: str, sizes: tuple[int, ...], pool):
        self.name = name
        self.sizes = tuple(sorted(sizes))
        self.pool = pool
        self.graphs: dict[int, PiecewiseGraph] = {}

    def capture(self, forward: Callable[[int, Cut], None]) -> float:
        """Capture every size, largest first, on a side stream (graphs cannot capture the default
        stream); returns seconds."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                forward(size, skip_gaps)  # warm-up outside the graph: lazy initialisations must not be captured
                stream.synchronize()
                graph = PiecewiseGraph(self.pool)
                graph.begin()
                forward(size, graph.cut)
                graph.end()
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def size_for(self, tokens: int) -> int | None:
        return captured_size_for(self.sizes, self.graphs, tokens)

    def replay(self, size: int, tokens: int) -> None:
        self.graphs[size].replay(tokens)


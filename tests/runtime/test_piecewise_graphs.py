"""The token-count ladder of piecewise CUDA graphs (the graphs themselves are tested on the GPU:
tests/gpu/test_cuda_graphs.py)."""

from specdec.runtime.piecewise_graphs import MAX_CAPTURED_TOKENS, PiecewiseGraph, PiecewiseGraphs, token_sizes


def test_sizes_cover_every_step_up_to_the_cap():
    sizes = token_sizes(5120)
    assert sizes[0] == 8 and sizes[-1] == 5120 and list(sizes) == sorted(set(sizes))
    assert max(b / a for a, b in zip(sizes[sizes.index(256):], sizes[sizes.index(256) + 1:])) <= 1.5
    assert token_sizes(17) == (8, 16, 17)
    assert token_sizes(10 * MAX_CAPTURED_TOKENS)[-1] == MAX_CAPTURED_TOKENS


def test_a_step_beyond_the_largest_size_runs_eagerly():
    graphs = PiecewiseGraphs("test", token_sizes(1000), pool=None)
    assert graphs.size_for(5) is None  # nothing captured yet: eager
    graphs.graphs = {size: PiecewiseGraph(None) for size in graphs.sizes}  # as if captured
    assert graphs.size_for(5) == 8 and graphs.size_for(385) == 512 and graphs.size_for(1000) == 1000
    assert graphs.size_for(1001) is None

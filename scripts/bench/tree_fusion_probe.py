"""A lone request's tree building, acceptance, node-row metadata and node-row copies (28 layers), each replayed from a
CUDA graph, as written against compiled (attention/fused.py): kernels per call, GPU microseconds per replay (CUDA
events over 200 replays, median of 30), whether both give the same values. A 15-node tree over a block of 16, 4
candidates a position, the default target's page size. GPU only.

    python scripts/bench/tree_fusion_probe.py
"""

from __future__ import annotations

import sys
import time

import torch

from attention.batch_layout import write_node_row_metadata
from attention.fused import fused
from attention.node_rows import copy_rows, node_copy_rows
from specdec.engine.token_tree import possible_nodes
from specdec.engine.tree_speculator import accept_trees, build_trees
from specdec.runtime.cuda_graphs import BatchGraphs, gpu_seconds


def graph_us(fn, repeats: int = 30, replays: int = 200) -> float:
    """GPU microseconds of one replay of `fn` captured as a step's small work is (`BatchGraphs`)."""
    graphs = BatchGraphs("probe", (1,), lambda size: fn())
    graphs.capture()
    graph = graphs.graphs[1]

    def replay_many() -> None:
        for _ in range(replays):
            graph.replay()

    return gpu_seconds(replay_many, repeats) / replays * 1e6


def kernels(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def pieces(dev: torch.device) -> dict:
    """name -> (function, its arguments, the arguments it writes, whose values after a call are compared)."""
    n, k, nodes, page_size = 15, 4, 15, 16
    logprobs, tokens = (torch.randn(1, n, 1000, device=dev) * 3).log_softmax(-1).topk(k, dim=-1)
    possible = possible_nodes(n, k, nodes, dev)
    tree_tokens, parents, depths, scores, ranks, mask, _ = build_trees(logprobs, tokens, nodes)
    chosen = torch.cat([tokens[:, 0, :1], tree_tokens], dim=1)
    context = torch.tensor([1234], device=dev)
    request_pages = torch.arange(200, dtype=torch.int32, device=dev)
    node_pages = torch.arange(300, 300 + 16 * 3, dtype=torch.int32, device=dev).view(16, 3)
    copy_args = (mask[0], context, request_pages, node_pages, page_size, 0)
    node_depths, source, destination = node_copy_rows(*copy_args)
    layers = [torch.randn(400 * 2 * page_size, 256, device=dev).to(torch.bfloat16) for _ in range(28)]
    planned = (torch.tensor([0, 78, 156, 234], dtype=torch.int32, device=dev),
               torch.tensor([16, 16, 16], dtype=torch.int32, device=dev),
               torch.arange(256, dtype=torch.int32, device=dev))

    def all_layers(rows_source, rows_destination):
        for rows in layers:
            copy_rows(rows, rows_source, rows_destination)

    return {
        "tree building": (build_trees, (logprobs, tokens, nodes, True, possible), ()),
        "acceptance": (accept_trees, (tree_tokens, parents, depths, scores, ranks, mask, chosen, n), ()),
        "node-row slots": (node_copy_rows, copy_args, ()),
        "node-row page metadata": (write_node_row_metadata, (*planned, context, node_depths[:2], page_size),
                                   planned),
        "node-row copies, one layer": (copy_rows, (layers[0], source, destination), (layers[0],)),
        "node-row copies, 28 layers": (all_layers, (source, destination), tuple(layers)),
    }


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print("| piece | kernels as written | GPU us as written | kernels compiled | GPU us compiled | compile s | equal |")
    print("|---|---|---|---|---|---|---|")
    for name, (fn, args, written) in pieces(dev).items():
        before = [t.clone() for t in written]
        want = fn(*args) or ()
        want_written = [t.clone() for t in written]
        for t, b in zip(written, before):
            t.copy_(b)
        start = time.perf_counter()
        compiled = fused(fn)
        got = compiled(*args) or ()
        compile_s = time.perf_counter() - start
        equal = all(torch.equal(a, b) for a, b in zip((*want, *want_written), (*got, *written)))
        plain_k, plain_us = kernels(lambda: fn(*args)), graph_us(lambda: fn(*args))
        fused_k, fused_us = kernels(lambda: compiled(*args)), graph_us(lambda: compiled(*args))
        print(f"| {name} | {plain_k} | {plain_us:.1f} | {fused_k} | {fused_us:.1f} | {compile_s:.1f} | {equal} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()

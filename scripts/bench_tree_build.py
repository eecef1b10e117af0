"""What building a token tree costs the GPU: every possible node at once against depth by depth.

    python scripts/bench_tree_build.py [--cases 1x15 4x15 1x31 1x63] [--out tree_build.json]   # GPU

A tree step builds its trees inside a CUDA graph (`build_trees`: the tree, its ancestor mask and the mask packed for
the verify's attention), where each kernel costs at least its launch. Per case (requests x nodes, a
block of 16 with 4 candidates a position, from random draft distributions): the GPU time of one replay of that
graph (CUDA events over 200 replays, median of 5), for both constructions (`TokenTree.build(at_once=...)`), and
whether they built the same trees (their scores aside, which may differ in the last bits). Trees of more than ~31
nodes are built depth by depth either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_tree_build.py`: the repo's packages
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from specdec.engine.tree_speculator import build_trees  # noqa: E402
from specdec.runtime.cuda_graphs import BatchGraphs, gpu_seconds  # noqa: E402

POSITIONS, CANDIDATES, VOCAB = 15, 4, 1000


def replay_us(batch: int, nodes: int, at_once: bool, repeats: int = 5, replays: int = 200
              ) -> tuple[float, tuple[torch.Tensor, ...]]:
    """GPU microseconds of one replay of the building graph (captured as the tree step captures it), and what it
    built."""
    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + nodes)
    logits = torch.randn(batch, POSITIONS, VOCAB, device="cuda", generator=g) * 3
    logprobs, tokens = logits.log_softmax(-1).topk(CANDIDATES, dim=-1)
    graphs = BatchGraphs("tree", (batch,), lambda size: build_trees(logprobs[:size], tokens[:size], nodes, at_once))
    graphs.capture()
    graph = graphs.graphs[batch]

    def replay_many() -> None:
        for _ in range(replays):
            graph.replay()

    return gpu_seconds(replay_many, repeats) / replays * 1e6, graphs.outputs[batch]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["1x15", "4x15", "1x31", "1x63"], help="requests x nodes")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_tree_build.py times CUDA graphs: it needs a GPU", file=sys.stderr)
        return 1
    rows = []
    for case in args.cases:
        batch, nodes = map(int, case.split("x"))
        at_once_us, at_once = replay_us(batch, nodes, True)
        by_depth_us, by_depth = replay_us(batch, nodes, False)
        same = all(torch.equal(at_once[i], by_depth[i]) for i in (0, 1, 2, 4, 5, 6))  # all but the scores
        rows.append({"requests": batch, "nodes": nodes, "at_once_us": at_once_us, "by_depth_us": by_depth_us,
                     "same_trees": same})
        print(f"{batch} x {nodes} nodes: at once {at_once_us:.1f} us, depth by depth {by_depth_us:.1f} us, "
              f"same trees {same}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

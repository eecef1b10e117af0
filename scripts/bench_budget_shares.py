"""What budget steps would accept: per request step, the drafter's confidence in each draft of its block and how many
the target accepted when it verified the whole chain; then, offline, what chains of each length and budgets of the
same rows (each request's share best-first by drafted reach, specdec/runtime/row_budget.py) would have accepted.

    python scripts/bench_budget_shares.py --model NAME --drafter PATH --dataset math500 --out shares.npz    # GPU
    python scripts/bench_budget_shares.py --quick                                                          # CPU smoke

Greedy, so what a step accepts of a prefix of its block is the whole chain's count cut to that prefix (the target's
tokens do not depend on how many rows ran). Every step verifies the whole chain (`verify="auto"` with budget steps,
its choice pinned to the block) without drafting ahead, so that each step's confidences are its own batch's.
--batch sets the budgets' batch: the recorded request steps are dealt into groups of that size (seeded), since the
engine's batches shrink as requests finish.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench.chat_prompts import load_prompts, take  # noqa: E402
from scripts.bench.random_models import TINY_SHAPE, random_target, tiny_drafter  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.runtime.row_budget import budget_lengths, budget_reach  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="demo name or HF model directory")
    p.add_argument("--drafter", help="DFlash drafter")
    p.add_argument("--dataset", default="math500", choices=("math500", "code", "mixed"))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="requests per budget (request steps dealt into groups)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", help="the recorded request steps (npz: confidence, accepted)")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny random model")
    return p.parse_args(argv)


def record(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(confidence [steps, n], accepted [steps]) of every request step of a run of `prompts`."""
    engine = llm.engine
    decoding, drafter = engine.decoding, engine.drafter
    block = drafter.block_size
    decoding.policy.choose = lambda batch, *args, **kwargs: block  # the whole chain, every step
    confidence, accepted = [], []
    step = decoding.step

    def recording(running, prefill=None):
        tokens = step(running, prefill)
        if drafter.confidence is not None:
            # a copy: the drafter's buffer is rewritten by the next step (on the CPU .cpu() and .numpy() share it)
            confidence.append(drafter.confidence[:len(running), :block - 1].float().cpu().numpy().copy())
            accepted.append(np.array([len(t) - 1 for t in tokens]))
        return tokens

    decoding.step = recording
    try:
        engine.generate_ids(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    finally:
        del decoding.step, decoding.policy.choose
    return np.concatenate(confidence), np.concatenate(accepted)


def shares_table(confidence: np.ndarray, accepted: np.ndarray, batch: int, seed: int = 0) -> str:
    """Tokens per request step of chains of q and of budgets of q rows a request on average, in whole blocks and in
    blocks of half of them (a request verifying at most that many tokens), the request steps dealt into groups of
    `batch`."""
    n = confidence.shape[1]
    half = (n + 1) // 2
    groups = np.array_split(np.random.default_rng(seed).permutation(len(accepted)),
                            max(1, len(accepted) // batch))

    def budget(per: int, block: int) -> float:
        tokens = 0
        for g in groups:
            c = torch.from_numpy(confidence[g, :block - 1])
            lengths = budget_lengths(budget_reach(c, len(g), per), len(g) * per).numpy()
            tokens += (1 + np.minimum(accepted[g], lengths - 1)).sum()
        return tokens / len(accepted)

    lines = [f"{len(accepted)} request steps in groups of ~{batch}; the whole chain ({n + 1}): "
             f"{1 + accepted.mean():.3f} tokens", "",
             f"| rows a request | chain | budget, blocks of {n + 1} | budget, blocks of {half} |", "|---|---|---|---|"]
    for per in range(2, min(n + 1, 9)):
        chain = 1 + np.minimum(accepted, per - 1).mean()
        in_half = f"{budget(per, half):.3f}" if per < half else "-"
        lines.append(f"| {per} | {chain:.3f} | {budget(per, n + 1):.3f} | {in_half} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, drafter = args.model, args.drafter
        if args.quick:
            args.device, args.requests, args.max_new_tokens, args.max_num_seqs = "cpu", 6, 12, 4
            model = str(random_target(Path(tmp) / "target", TINY_SHAPE, torch.device("cpu"), std=0.2))
            drafter = str(tiny_drafter(Path(tmp) / "drafter", Path(model)))
        llm = LLM(model, drafter, device=args.device, max_num_seqs=args.max_num_seqs, verify="auto",
                  budget_steps=True, overlap_steps=False)
        if args.quick:
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(args.requests)]
        else:
            prompts = [llm.encode_chat([{"role": "user", "content": p.text}])
                       for p in take(load_prompts(args.dataset, seed=0), args.requests)]
        confidence, accepted = record(llm, prompts, args.max_new_tokens)
    if args.out:
        np.savez_compressed(args.out, confidence=confidence, accepted=accepted)
    print(shares_table(confidence, accepted, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay greedy decoding over a drafter's teacher-forced acceptances on an eval run's own outputs.

    python scripts/replay_decoding.py RESULTS.json --set humaneval|math500 [--drafter PATH] [--limit 16]

For each problem of an `eval.*` results.json (the prompt rebuilt by the eval's own prompt code, the
recorded output re-tokenized, EOS appended) the drafter's acceptance length is computed at every
response position in one training-style forward (`Trainer.batch_loss`, the frozen target through
transformers); then decoding is replayed: the first block starts at the first output token and each
next one where the last one's accepted tokens end. Prints per problem the replayed mean acceptance,
the mean over all anchors (what random-anchor estimates average) and the tau the engine measured.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer

from drafters import DEFAULT_DRAFTERS, resolve_drafter_path
from drafters.dflash_model import load_dflash
from drafters.training.anchors import acceptance_lengths, decoding_walk, first_anchors
from drafters.training.data import TokenSamples
from drafters.training.target import FrozenTarget
from drafters.training.trainer import TrainConfig, Trainer
from eval.chat_prompt import chat_prompt_ids
from specdec.weights.demo_models import DEFAULT_TARGET, resolve_model


def problem_set(name: str):
    if name == "humaneval":
        from eval.humaneval import HUMANEVAL
        return HUMANEVAL
    from eval.math500 import MATH500
    return MATH500


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="results.json of python -m eval.humaneval / eval.math500")
    p.add_argument("--set", choices=["humaneval", "math500"], required=True)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=None, help="default: the target's shipped drafter")
    p.add_argument("--data", default=None, help="the eval's --data, if it had one")
    p.add_argument("--limit", type=int, default=16, help="the first N problems of the results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    drafter = load_dflash(resolve_drafter_path(args.drafter or DEFAULT_DRAFTERS[args.target]), device, torch.float32)
    target = FrozenTarget.load(args.target, drafter.spec.target_layer_ids, device, dtype)
    definition = problem_set(args.set)
    problems = definition.load(args.data)
    records = json.loads(Path(args.results).read_text())["problems"][:args.limit]
    rows = [(chat_prompt_ids(tokenizer, definition.user_turn(problems[int(r["index"])]), args.set),
             tokenizer.encode(r["output"], add_special_tokens=False) + [tokenizer.eos_token_id], i)
            for i, r in enumerate(records)]
    samples = TokenSamples.from_lists(rows)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(TrainConfig(out_dir=out, batch_size=1, max_length=8192), drafter, target, samples)
        trainer.model.eval()
        totals = {"replayed": [], "all anchors": [], "measured": []}
        for i, record in enumerate(records):
            with torch.no_grad():
                result, anchors = trainer.batch_loss(samples, [i], lambda mask: first_anchors(mask, 8192))
            lengths = acceptance_lengths(result.correct)[0]
            walk = decoding_walk(lengths, anchors.valid[0])
            row = {"replayed": sum(walk) / len(walk), "all anchors": lengths[result.full_blocks[0]].float().mean().item(),
                   "measured": float(record["tau"])}
            for k, v in row.items():
                totals[k].append(v)
            print(f"{record['id']}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    print(f"mean over {len(records)} problems: " + ", ".join(f"{k} {sum(v) / len(v):.3f}" for k, v in totals.items()))


if __name__ == "__main__":
    main()

"""Train a DFlash drafter for a target on shards from generate_training_data.py.

    python scripts/train_drafter.py --data data/train-qwen2.5-coder-1.5b --out runs/dflash-qc15 \
        [--target qwen2.5-coder-1.5b-instruct] [--max-steps 3000] [--batch-size 8] \
        [--anchors-per-seq 256] [--time-budget-s 540] [--resume]

Drafter shape: --draft-layers, --heads, --kv-heads, --head-dim, --intermediate-size, --target-layer-ids,
--block-size, --mask-token-id. With --resume and a checkpoint in --out, the checkpoint's shape and state win and
training continues where it stopped (same batches, same anchors as an uninterrupted run). --init-from DRAFTER starts
a new run from an exported drafter's weights and shape (any storage), e.g. to train a shipped drafter further with a
fresh schedule; shape flags given with it grow that drafter (more draft layers, a wider MLP, more target layers)
without changing what it computes (`drafters.training.grow`). --quant-aware STORAGE trains with the weights that
export's --storage STORAGE writes (`drafters.training.quant_aware`). --eval-only scores the starting weights and
stops: with --init-from a stored drafter, what its storage costs on held-out acceptance. Held-out data: the prompts
whose hash falls in the lowest --eval-fraction (the same prompts in every run, whatever the data's order or recipe),
scored per domain (math, code, ...); --domain-repeats math=2 counts each training sample of that domain twice per
epoch (held-out scoring unchanged). Progress: a tqdm bar (loss, lr, batch tau, held-out tau), a line of held-out tau
per domain at each evaluation, and <out>/log.jsonl (one line per evaluation, per-domain numbers under "domains").
Export with scripts/export_drafter.py.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

from drafters.training.quant_aware import QUANT_AWARE_STORAGES
from specdec.weights.demo_models import DEFAULT_TARGET


def domain_repeat(text: str) -> tuple[str, int]:
    """DOMAIN=N of --domain-repeats."""
    name, sep, count = text.partition("=")
    if not sep or not name or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"expected DOMAIN=N with N a whole number >= 1 (e.g. math=2), got {text!r}")
    return name, int(count)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="directories of training shards (several: their samples together, e.g. data generated "
                        "from different prompt lists)")
    p.add_argument("--domain-repeats", nargs="+", type=domain_repeat, default=[], metavar="DOMAIN=N",
                   help="train on each sample of DOMAIN N times per epoch (held-out scoring unchanged), e.g. math=2 "
                        "beside twice as many code answers")
    p.add_argument("--out", required=True, help="run directory: checkpoint.pt and log.jsonl")
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo name or HF model directory")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt when present")
    p.add_argument("--device", default="auto")
    p.add_argument("--eval-only", action="store_true",
                   help="score the starting weights on the held-out data (one log line), train nothing; e.g. "
                        "--init-from a stored drafter to measure what its weight storage costs")
    p.add_argument("--init-from", default=None, metavar="DRAFTER",
                   help="exported drafter directory whose weights (and shape) a new run starts from")
    # drafter shape (defaults: DrafterShape's); with --init-from, the ones given grow the drafter to them
    p.add_argument("--draft-layers", type=int, default=None, help="default 2")
    p.add_argument("--heads", type=int, default=None, help="default 8")
    p.add_argument("--kv-heads", type=int, default=None, help="default 2")
    p.add_argument("--head-dim", type=int, default=None, help="default 128")
    p.add_argument("--intermediate-size", type=int, default=None, help="default 768")
    p.add_argument("--target-layer-ids", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="comma-separated, e.g. 1,13,25 (default: spread over the target like z-lab's)")
    p.add_argument("--block-size", type=int, default=None, help="default 16")
    p.add_argument("--mask-token-id", type=int, default=151669)
    # optimisation
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors-per-seq", type=int, default=256)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 for bs 16, 4 for bs 8)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-frac", type=float, default=0.04)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--loss-chunk", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-fraction", type=float, default=0.01,
                   help="share of prompts held out for the tau estimate, chosen by a hash of the prompt")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences of each domain per evaluation")
    p.add_argument("--eval-anchors-per-seq", type=int, default=256,
                   help="every anchor among the first this many response positions of a held-out sequence")
    p.add_argument("--quant-aware", default=None, metavar="STORAGE", choices=QUANT_AWARE_STORAGES,
                   help="train with the weights as STORAGE holds them (straight-through rounding), so that the "
                        "drafter exported with --storage STORAGE loses nothing; e.g. q4_0 for twice the weights in "
                        "the bytes of fp8")
    p.add_argument("--block-sizes", type=lambda s: tuple(int(n) for n in s.split(",")), default=(), metavar="N,N",
                   help="train shorter blocks as well: each block's size is drawn uniformly from these and the whole "
                        "block, and the drafter declares them; the engine then drafts the short chains it verifies "
                        "under load from the shortest such block (e.g. 2,4,8)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget of this call, model loading included; checkpoints and stops before it")
    return p.parse_args(argv)


SHAPE_ARGUMENTS = {"draft_layers": "num_layers", "heads": "heads", "kv_heads": "kv_heads", "head_dim": "head_dim",
                   "intermediate_size": "intermediate_size", "block_size": "block_size",
                   "target_layer_ids": "target_layer_ids"}  # flag -> DrafterShape field


def shape_arguments(args) -> dict:
    """The DrafterShape fields the command line gives."""
    return {field: getattr(args, flag) for flag, field in SHAPE_ARGUMENTS.items() if getattr(args, flag) is not None}


def main(argv=None) -> None:
    started = time.monotonic()
    args = parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from drafters.training.checkpoint import config_from_json, load_checkpoint
    from drafters.training.data import load_samples
    from drafters.training.drafter_config import (DrafterShape, default_gamma, drafter_config, storage_bytes,
                                                  new_drafter, parameter_counts)
    from drafters.training.grow import grow, shape_of
    from drafters.training.target import FrozenTarget, check_mask_token
    from drafters.training.trainer import TrainConfig, Trainer
    from drafters.compatibility import check_compatible
    from drafters.dflash_model import DFlashDraftModel, load_dflash
    from specdec.weights.demo_models import resolve_model

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    target_dir = resolve_model(args.target)
    target_config = AutoConfig.from_pretrained(target_dir)
    checkpoint = load_checkpoint(args.out) if args.resume else None
    if checkpoint is not None:
        config = config_from_json(checkpoint["drafter_config"])
        drafter = DFlashDraftModel(config)
        print(f"resuming {args.out} at step {checkpoint['step']} (shape from the checkpoint)")
    elif args.init_from:
        drafter = load_dflash(args.init_from, torch.device("cpu"), torch.float32)
        check_compatible(drafter.config, target_config, args.init_from)  # before the target loads
        given = shape_arguments(args)
        if given:
            drafter = grow(drafter, target_config, replace(shape_of(drafter), **given), args.seed)
            print(f"starting from the weights of {args.init_from}, grown to {given} (computing the same)")
        else:
            print(f"starting from the weights of {args.init_from} (shape from the drafter)")
        drafter = drafter.float().train().requires_grad_(True)
        config = drafter.config
    else:
        config = drafter_config(target_config, DrafterShape(**shape_arguments(args)), args.mask_token_id)
        drafter = new_drafter(config, args.seed)
    spec = drafter.spec
    tokenizer = AutoTokenizer.from_pretrained(target_dir) if (target_dir / "tokenizer_config.json").is_file() else None
    check_mask_token(spec.mask_token_id, target_config.vocab_size, tokenizer)
    counts = parameter_counts(config)
    print(f"drafter: {config.num_hidden_layers} layers, {config.num_attention_heads}/{config.num_key_value_heads} "
          f"heads x {config.head_dim}, intermediate {config.intermediate_size}, target layers "
          f"{list(spec.target_layer_ids)}, block {spec.block_size}: {counts['total'] / 1e6:.2f}M parameters, "
          "stored " + ", ".join(f"{s} {storage_bytes(config, s) / 2**20:.2f}" for s in ("bf16", "fp8", "q5_0", "q4_0"))
          + " MiB")

    train_data, eval_data = load_samples(*args.data).split_held_out(args.eval_fraction, seed=args.seed)
    train_data = train_data.with_domain_repeats(dict(args.domain_repeats))
    if args.eval_only and len(eval_data) == 0:
        raise SystemExit(f"--eval-only: no held-out sequences in {' '.join(args.data)} at --eval-fraction {args.eval_fraction}; "
                         f"raise it")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = FrozenTarget.load(target_dir, spec.target_layer_ids, device, dtype)
    trained, held = train_data.domain_indices(), eval_data.domain_indices()
    per_domain = ", ".join(f"{d} {len(trained.get(d, ()))}+{len(held.get(d, ()))}" for d in sorted(trained.keys() | held.keys()))
    print(f"data: {len(train_data)} training sequences, {len(eval_data)} held out (per domain, training+held out: "
          f"{per_domain})")
    train_config = TrainConfig(
        out_dir=args.out, max_steps=args.max_steps, batch_size=args.batch_size, anchors_per_seq=args.anchors_per_seq,
        max_length=args.max_length, gamma=args.gamma or default_gamma(spec.block_size), lr=args.lr,
        weight_decay=args.weight_decay, warmup_frac=args.warmup_frac, grad_clip=args.grad_clip,
        loss_chunk=args.loss_chunk, seed=args.seed, save_every=args.save_every, eval_every=args.eval_every,
        eval_sequences=args.eval_sequences, eval_anchors_per_seq=args.eval_anchors_per_seq,
        time_budget_s=args.time_budget_s, quant_aware=args.quant_aware, block_sizes=args.block_sizes)
    trainer = Trainer(train_config, drafter, target, train_data, eval_data, start_time=started)
    if args.eval_only:
        record = {"drafter": args.init_from, **trainer.evaluate()}
        trainer.log(record)
        print(json.dumps(record))
        return
    if checkpoint is not None:
        trainer.resume()
    trainer.train()
    state = "done" if trainer.step >= train_config.max_steps else "stopped for the time budget; run again with --resume"
    print(f"step {trainer.step}/{train_config.max_steps}: {state}. checkpoint: {args.out}/checkpoint.pt")


if __name__ == "__main__":
    main()

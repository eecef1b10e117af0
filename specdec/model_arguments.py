"""Command-line arguments that pick the model, drafter and KV cache, shared by every entry point that
builds an `LLM` (`python -m specdec.generate`, `python -m eval.math500`)."""

from __future__ import annotations

import argparse

from specdec.config import DTYPES, KV_CACHE_DTYPES
from specdec.llm import DEFAULT_TARGET


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo model name, HF model directory or .gguf file")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory (z-lab format) or shipped name; "
                                                   "default: the target's shipped drafter, if any")
    p.add_argument("--no-drafter", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto")
    p.add_argument("--num-kv-pages", type=int, default=None, help="KV pool size in pages (default: from memory)")


def chosen_drafter(args: argparse.Namespace) -> str | None:
    """--drafter, else the target's shipped drafter; None with --no-drafter or when none is shipped."""
    if args.no_drafter:
        return None
    from drafters import DEFAULT_DRAFTERS  # drafters imports the engine: keep `--help` light

    return args.drafter or DEFAULT_DRAFTERS.get(args.target)

"""Command-line arguments that pick the model, drafter and KV cache, shared by every entry point that
builds an `LLM` (`python -m specdec.generate`, `python -m eval.math500`)."""

from __future__ import annotations

import argparse
import re

from specdec.config import DTYPES, KV_CACHE_DTYPES
from specdec.llm import DEFAULT_TARGET

VALID_DEVICES = "auto, cpu, cuda, cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every argument's default, unless its help already says what the default is."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def device_arg(value: str) -> str:
    """--device: auto, cpu, cuda or cuda:N (checked when the arguments are parsed)."""
    device = value.strip().lower()
    if not _DEVICE.fullmatch(device):
        raise argparse.ArgumentTypeError(f"invalid device {value!r}; valid: {VALID_DEVICES}")
    return device


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    if p.formatter_class is argparse.HelpFormatter:  # show defaults in --help (a parser's own choice wins)
        p.formatter_class = DefaultsHelpFormatter
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo model name, HF model directory or .gguf file")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory (z-lab format) or shipped name; "
                                                   "None = the target's shipped drafter, if any")
    p.add_argument("--no-drafter", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the target's KV cache: auto = the model dtype, fp8 = float8 e4m3")
    p.add_argument("--drafter-kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the drafter's context cache (auto = the model dtype)")
    p.add_argument("--device", type=device_arg, default="auto",
                   help=f"{VALID_DEVICES} (auto = cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="model dtype (auto = bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pool size in pages (None = sized from free memory)")
    p.add_argument("--calibrate-fp8-scales", action="store_true",
                   help="FP8 KV: per-layer scales from the first prefill (otherwise scale 1.0)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly (no CUDA graphs; CPU is always eager)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Memory and kernel settings of the engine (`engine_settings` reads them back)."""
    p.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory the engine may use (weights, KV pool, graphs)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer"], default="auto",
                   help="attention kernels (auto = flashinfer on CUDA when installed, else torch)")


def engine_settings(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments that `add_engine_arguments` collected."""
    return dict(page_size=args.page_size, gpu_memory_utilization=args.gpu_memory_utilization,
                attention_backend=args.attention_backend)


def chosen_drafter(args: argparse.Namespace) -> str | None:
    """--drafter, else the target's shipped drafter; None with --no-drafter or when none is shipped."""
    if args.no_drafter:
        return None
    from drafters import DEFAULT_DRAFTERS  # drafters imports the engine: keep `--help` light

    return args.drafter or DEFAULT_DRAFTERS.get(args.target)


def engine_options(args: argparse.Namespace) -> dict:
    """The `LLM` keyword arguments that `add_model_arguments` collected."""
    return dict(device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                drafter_kv_cache_dtype=args.drafter_kv_cache_dtype, num_kv_pages=args.num_kv_pages,
                calibrate_fp8_scales=args.calibrate_fp8_scales, enforce_eager=args.enforce_eager)

"""Export a drafter to the z-lab DFlash format: from a training run, or re-store a drafter (a shipped name
or a directory) in another weight storage.

    python scripts/export_drafter.py runs/dflash-qc15 drafters/checkpoints/NAME [--storage bf16|fp8|q5_0|...]
    python scripts/export_drafter.py qwen2.5-coder-1.5b-dflash-b16 /tmp/drafter-bf16      # for vLLM / SGLang

bf16 (default): config.json + bf16 model.safetensors, the format z-lab's `dflash` package
(`DFlashDraftModel.from_pretrained`), vLLM and SGLang read, as does our `drafters.load_drafter`.
fp8: the same file layout with every Linear weight stored as float8 e4m3 plus a float32 scale per
output channel (`<name>` and `<name>_scale`), norms in bf16, and `"weight_storage":
"fp8_e4m3_per_channel"` at the top level of config.json; about half the size. Only our loader reads
it (it dequantizes to the compute dtype at load); the other readers need the bf16 export. q8_0, q5_0, q5_1,
q4_1, q4_0: GGML block quantization of the Linear weights (`drafters.weight_storage`), smaller still. The
shipped drafters are stored compactly: export them with the default bf16 storage before handing them to a peer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def load_source(source: str, device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.bfloat16):
    """A training run (its checkpoint; float32) or a drafter directory / shipped name, loaded the way the engine
    loads it (fp8 storage dequantized straight to `dtype`), so an export holds the weights the engine runs."""
    from drafters import resolve_drafter_path
    from drafters.dflash_model import load_dflash
    from drafters.training.checkpoint import checkpoint_path, drafter_from_checkpoint

    if Path(checkpoint_path(source)).is_file() or Path(source).is_file():
        return drafter_from_checkpoint(source)
    return load_dflash(resolve_drafter_path(source), device, dtype)


def export(source: str, out: str, storage: str = "bf16", device: torch.device = torch.device("cpu"),
           dtype: torch.dtype = torch.bfloat16) -> Path:
    """Writes the drafter to `out` (bf16 storage in `dtype`, or a compact storage); returns the weights file."""
    from drafters.dflash_model import WEIGHTS_FILE, save_dflash

    model = load_source(source, device, dtype)
    save_dflash(model, out, dtype=dtype, storage=storage)
    return Path(out) / WEIGHTS_FILE


def main(argv=None) -> None:
    from drafters.weight_storage import STORAGES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="training run directory (or its checkpoint.pt), or a drafter: shipped name or "
                                  "directory")
    p.add_argument("out", help="directory to write config.json and model.safetensors into")
    p.add_argument("--storage", choices=STORAGES, default="bf16")
    args = p.parse_args(argv)
    weights = export(args.source, args.out, args.storage)
    print(f"{args.out}: {args.storage} weights, {weights.stat().st_size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

"""Export a trained drafter from a training checkpoint to the z-lab DFlash format.

    python scripts/export_drafter.py runs/dflash-qc15 drafters/checkpoints/NAME [--storage bf16|fp8]

bf16 (default): config.json + bf16 model.safetensors, the format z-lab's `dflash` package
(`DFlashDraftModel.from_pretrained`), vLLM and SGLang read, as does our `drafters.load_drafter`.
fp8: the same file layout with every Linear weight stored as float8 e4m3 plus a float32 scale per
output channel (`<name>` and `<name>_scale`), norms in bf16, and `"weight_storage":
"fp8_e4m3_per_channel"` at the top level of config.json; about half the size. Only our loader reads
it (it dequantizes to the compute dtype at load); the other readers need the bf16 export.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def export(checkpoint: str, out: str, storage: str = "bf16") -> Path:
    from drafters.dflash_model import WEIGHTS_FILE, save_dflash
    from drafters.training.checkpoint import drafter_from_checkpoint

    model = drafter_from_checkpoint(checkpoint)
    save_dflash(model, out, storage=storage)
    return Path(out) / WEIGHTS_FILE


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="training run directory (or its checkpoint.pt)")
    p.add_argument("out", help="directory to write config.json and model.safetensors into")
    p.add_argument("--storage", choices=("bf16", "fp8"), default="bf16")
    args = p.parse_args(argv)
    weights = export(args.checkpoint, args.out, args.storage)
    print(f"{args.out}: {args.storage} weights, {weights.stat().st_size / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

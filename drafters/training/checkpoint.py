"""Training checkpoints: one file, replaced atomically, holding everything a resumed run needs.

    <out_dir>/checkpoint.pt = {
        "drafter_config": JSON of the drafter config, "model": fp32 state dict,
        "optimizer", "scheduler": state dicts, "step", "epoch", "batch_in_epoch",
        "since_log": (loss, tau) of the steps not yet in a log line,
        "rng": torch CPU (and CUDA) generator states, "train_config": the run's settings }
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import Qwen3Config

from drafters.dflash_model import DFlashDraftModel

CHECKPOINT_FILE = "checkpoint.pt"


def checkpoint_path(out_dir: str | os.PathLike) -> Path:
    path = Path(out_dir)
    return path if path.suffix == ".pt" else path / CHECKPOINT_FILE


def save_checkpoint(out_dir: str | os.PathLike, state: dict) -> None:
    path = checkpoint_path(out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(out_dir: str | os.PathLike) -> dict | None:
    path = checkpoint_path(out_dir)
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def config_to_json(config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


def config_from_json(text: str) -> Qwen3Config:
    return Qwen3Config.from_dict(json.loads(text))


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def drafter_from_checkpoint(out_dir: str | os.PathLike) -> DFlashDraftModel:
    """The trained drafter (fp32, CPU) from a training checkpoint file or directory."""
    state = load_checkpoint(out_dir)
    if state is None:
        raise FileNotFoundError(f"no training checkpoint at {checkpoint_path(out_dir)}")
    model = DFlashDraftModel(config_from_json(state["drafter_config"]))
    model.load_state_dict(state["model"])
    return model.float().eval()

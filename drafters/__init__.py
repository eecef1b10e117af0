"""Drafter implementations (DFlash) and their loading; built on attention/ and specdec's models, runtime and
drafter interface, never on the engine's internals."""

from __future__ import annotations

import os
from pathlib import Path

from drafters.dflash import DFlashDrafter
from drafters.dflash_model import read_dflash_config
from drafters.token_ranking import read_token_ranking
from specdec.engine.drafter import Drafter
from specdec.weights.demo_models import DEFAULT_TARGET
from specdec.weights.hub import check_revision, hub_snapshot, looks_like_repo_id

CHECKPOINTS = Path(__file__).parent / "checkpoints"
# target demo name -> its shipped default drafter (a folder under drafters/checkpoints)
DEFAULT_DRAFTERS: dict[str, str] = {DEFAULT_TARGET: "qwen2.5-coder-1.5b-dflash-b16"}


def resolve_drafter_path(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """A drafter's directory: a local one, a shipped drafter's, or a Hugging Face Hub id's (fetched into its cache, at
    `revision` if given)."""
    check_revision(os.fspath(name_or_path), revision)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    shipped = CHECKPOINTS / str(name_or_path)
    if shipped.is_dir():
        return shipped
    if looks_like_repo_id(os.fspath(name_or_path)):
        return hub_snapshot(os.fspath(name_or_path), revision)
    known = sorted(p.name for p in CHECKPOINTS.glob("*") if p.is_dir()) if CHECKPOINTS.is_dir() else []
    raise FileNotFoundError(f"drafter {str(name_or_path)!r} is neither a directory, a shipped drafter (shipped: "
                            f"{', '.join(known) or 'none'}) nor a Hugging Face Hub id (org/name)")


def load_drafter(name_or_path: str | os.PathLike, target_model, revision: str | None = None) -> Drafter:
    """A DFlash drafter for `target_model` (a specdec CausalLM), checked for compatibility first (`revision`: of a
    Hub id)."""
    from drafters.compatibility import check_compatible
    from drafters.dflash_model import load_dflash

    path = resolve_drafter_path(name_or_path, revision)
    check_compatible(read_dflash_config(path), target_model.config, str(path))
    device = target_model.lm_head.weight.device
    dtype = target_model.lm_head.weight.dtype
    return DFlashDrafter(load_dflash(path, device, dtype), read_token_ranking(path))


__all__ = ["Drafter", "DFlashDrafter", "load_drafter", "DEFAULT_DRAFTERS", "resolve_drafter_path"]

"""Drafters propose blocks of tokens for the target to verify."""

from __future__ import annotations

# target demo name -> its shipped default drafter (a folder under drafters/checkpoints)
DEFAULT_DRAFTERS: dict[str, str] = {}


def load_drafter(name_or_path, target_model):
    raise NotImplementedError("DFlash drafters are not available yet")

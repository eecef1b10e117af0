"""Engines over tiny test models."""

from __future__ import annotations

import torch

from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.models.loader import LoadedTarget, load_causal_lm


def tiny_target(path, eos=(2,)) -> LoadedTarget:
    return LoadedTarget(load_causal_lm(path, torch.device("cpu"), torch.float32), None, frozenset(eos), path)


def tiny_engine(path, drafter=None, eos=(2,), **config) -> Engine:
    config.setdefault("num_kv_pages", 256)
    config.setdefault("page_size", 4)
    return Engine(tiny_target(path, eos), EngineConfig(device="cpu", **config), drafter)


PROMPTS = [[5, 17, 33, 9, 11, 40], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], [3]]

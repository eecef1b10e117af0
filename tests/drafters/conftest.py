"""The tiny target and random drafter that the drafter and training tests start from."""

import pytest
import torch

from drafters.training.drafter_config import drafter_config, new_drafter
from tests.conftest import build_tiny_model
from tests.training_helpers import MASK, SHAPE


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    hf = build_tiny_model("qwen3", root / "target", seed=7)
    config = drafter_config(hf.config, SHAPE, MASK)
    drafter = new_drafter(config, seed=1, std=0.2)
    with torch.no_grad():  # norms away from 1 so that every weight matters
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return root, hf, drafter

"""Compact drafter weight storage (drafters.weight_storage): GGML block types written and read back
through the `gguf` package, their size and error, and clear refusals."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from drafters import load_drafter
from drafters.dflash_model import WEIGHTS_FILE, load_dflash, read_dflash_config, save_dflash
from drafters.training.drafter_config import drafter_config, new_drafter, storage_bytes
from drafters.weight_storage import GGML_TYPES
from tests.engine_helpers import tiny_target
from tests.training_helpers import MASK, SHAPE

MAX_RELATIVE_ERROR = {"q8_0": 0.01, "q5_0": 0.06, "q5_1": 0.06, "q4_1": 0.12, "q4_0": 0.12}


@pytest.mark.parametrize("storage", GGML_TYPES)
def test_ggml_storage_round_trip(setup, tmp_path, storage):
    root, hf, drafter = setup
    save_dflash(drafter, tmp_path / storage, storage=storage)
    save_dflash(drafter, tmp_path / "fp8", storage="fp8")
    assert read_dflash_config(tmp_path / storage).weight_storage == f"ggml_{storage}"
    loaded = load_dflash(tmp_path / storage, torch.device("cpu"), torch.float32).state_dict()
    kind = GGMLQuantizationType[storage.upper()]
    for name, w in drafter.state_dict().items():
        if w.dim() < 2:  # norms: bf16
            assert torch.equal(loaded[name], w.to(torch.bfloat16).float()), name
            continue
        # exactly what gguf's own dequantization of its quantization gives
        want = quants.dequantize(quants.quantize(w.float().numpy(), kind), kind)
        assert np.array_equal(loaded[name].numpy(), want), name
        error = ((loaded[name] - w).norm() / w.norm()).item()
        assert 0 < error < MAX_RELATIVE_ERROR[storage], (name, error)
    size = (tmp_path / storage / WEIGHTS_FILE).stat().st_size
    weights = storage_bytes(drafter.config, storage)
    assert weights <= size <= weights + 16 * 1024  # the estimate plus the safetensors header
    if storage != "q8_0":
        assert size < (tmp_path / "fp8" / WEIGHTS_FILE).stat().st_size
    load_drafter(tmp_path / storage, tiny_target(root / "target", eos=()).model)  # the engine's loader reads it


def test_storage_refusals(setup, tmp_path):
    root, hf, drafter = setup
    with pytest.raises(ValueError, match="unknown weight storage 'q3_k'"):
        save_dflash(drafter, tmp_path / "bad", storage="q3_k")
    odd = new_drafter(drafter_config(hf.config, replace(SHAPE, intermediate_size=80), MASK))
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight: rows of 80 weights cannot be stored as ggml_q4_0 "
                                         r"\(blocks of 32\); use --storage fp8 or bf16"):
        save_dflash(odd, tmp_path / "odd", storage="q4_0")
    save_dflash(drafter, tmp_path / "q4", storage="q4_0")
    config_file = tmp_path / "q4" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "weight_storage": "int3_magic"}))
    with pytest.raises(ValueError, match="unknown weight_storage 'int3_magic'"):
        load_dflash(tmp_path / "q4", torch.device("cpu"), torch.float32)

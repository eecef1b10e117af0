"""The shipped default drafter: small enough to ship, in the DFlash format, fits the default target."""

import torch
from transformers import Qwen2Config

from drafters import DEFAULT_DRAFTERS, resolve_drafter_path
from drafters.compatibility import check_compatible
from drafters.dflash_model import load_dflash, read_dflash_config

TARGET = "qwen2.5-coder-1.5b-instruct"
MAX_BYTES = 20 * 2 ** 20


def default_target_config():
    """The architecture of the default demo target (Qwen2.5-Coder-1.5B-Instruct as converted from GGUF)."""
    return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                       tie_word_embeddings=False)


def test_default_drafter_is_shipped_small_and_compatible():
    path = resolve_drafter_path(DEFAULT_DRAFTERS[TARGET])
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= MAX_BYTES, f"{path} takes {size} bytes"
    spec = check_compatible(read_dflash_config(path), default_target_config(), str(path))
    assert spec.block_size == 16 and spec.mask_token_id == 151669
    assert spec.draft_window == 2048  # its training sequences were cut at 2048 tokens (train_drafter's default)


def test_default_drafter_loads_and_dequantizes():
    model = load_dflash(resolve_drafter_path(DEFAULT_DRAFTERS[TARGET]), torch.device("cpu"), torch.float32)
    weights = dict(model.named_parameters())
    assert weights["fc.weight"].shape == (1536, 1536 * len(model.spec.target_layer_ids))
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not any(name.endswith("_scale") for name in model.state_dict())

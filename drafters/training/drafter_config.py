"""The shape of a drafter to train: its config (z-lab's DFlash fields on a Qwen3 layer config),
fresh weights, and what it costs on disk. `save_random_drafter` writes such a fresh drafter as a
checkpoint, for runs where the weights' values do not matter (tests, timing, a device check)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Qwen3Config

from drafters.dflash_model import DFlashDraftModel, default_target_layer_ids, save_dflash
from drafters.weight_storage import linear_bytes
from specdec.models.layers import RMSNorm

# SpecForge's loss decay per block size (gamma = 7 for bs 16, 4 for bs 8); other sizes scale linearly
GAMMA_BY_BLOCK_SIZE = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return GAMMA_BY_BLOCK_SIZE.get(block_size, max(1.0, 7.0 * block_size / 16))


@dataclass(frozen=True)
class DrafterShape:
    num_layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    intermediate_size: int = 768
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None  # None: default_target_layer_ids(target layers, num_layers)

    def __post_init__(self):
        problems = []
        if min(self.num_layers, self.heads, self.kv_heads, self.head_dim, self.intermediate_size) < 1:
            problems.append("layers, heads, kv heads, head_dim and intermediate size must be positive")
        elif self.heads % self.kv_heads:
            problems.append(f"heads {self.heads} must be a multiple of kv heads {self.kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} must be even (RoPE)")
        if self.block_size < 2:
            problems.append(f"block_size {self.block_size} must be >= 2")
        if problems:
            raise ValueError("invalid drafter shape: " + "; ".join(problems))


def drafter_config(target_config, shape: DrafterShape, mask_token_id: int) -> Qwen3Config:
    """A DFlash config for `target_config` (hidden size, rope, norm eps and vocabulary follow the target)."""
    layers = target_config.num_hidden_layers
    ids = list(shape.target_layer_ids or default_target_layer_ids(layers, shape.num_layers))
    bad = [i for i in ids if not 0 <= i < layers]
    if bad:
        raise ValueError(f"target layer ids {bad} are outside the target's layers 0..{layers - 1}")
    rope = dict(target_config.rope_parameters)
    config = Qwen3Config(vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
                         intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         max_position_embeddings=target_config.max_position_embeddings,
                         rms_norm_eps=target_config.rms_norm_eps, rope_parameters=rope,
                         hidden_act="silu", attention_bias=False, tie_word_embeddings=False)
    if "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]  # top-level copy for readers of the pre-5 transformers layout
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = layers
    config.block_size = shape.block_size
    config.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": ids}
    return config


def new_drafter(config, seed: int = 0, std: float = 0.02, norm_std: float = 0.0) -> DFlashDraftModel:
    """Fresh fp32 weights: N(0, std) for Linear weights; norms 1 + N(0, norm_std), so ones by default
    (transformers' init); a norm_std > 0 makes every norm weight matter, as a test of a loader wants."""
    model = DFlashDraftModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=g)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm) and norm_std:
                module.weight.normal_(1.0, norm_std, generator=g)
    return model.float()


def save_random_drafter(path, target_config, shape: DrafterShape, mask_token_id: int | None = None, *, seed: int = 0,
                        std: float = 0.02, norm_std: float = 0.0, dtype: torch.dtype = torch.bfloat16
                        ) -> DFlashDraftModel:
    """A drafter of `shape` for `target_config` with fresh weights (`new_drafter`), saved to `path` in the
    z-lab format; the mask token is the vocabulary's last id unless given. Returns the fp32 model."""
    mask = target_config.vocab_size - 1 if mask_token_id is None else mask_token_id
    model = new_drafter(drafter_config(target_config, shape, mask), seed, std, norm_std)
    save_dflash(model, path, dtype=dtype)
    return model


def parameter_counts(config) -> dict[str, int]:
    """Weights per part: fc, one layer's attention and MLP, norms, total."""
    hidden = config.hidden_size
    n_ids = len(config.dflash_config["target_layer_ids"])
    hd = config.head_dim
    attention = 2 * hidden * config.num_attention_heads * hd + 2 * hidden * config.num_key_value_heads * hd
    mlp = 3 * hidden * config.intermediate_size
    norms = 2 * hidden + config.num_hidden_layers * (2 * hidden + 2 * hd)
    counts = {"fc": n_ids * hidden * hidden, "attention_per_layer": attention, "mlp_per_layer": mlp, "norms": norms}
    counts["total"] = counts["fc"] + config.num_hidden_layers * (attention + mlp) + norms
    return counts


def storage_bytes(config, storage: str) -> int:
    """Weight bytes of `storage` (drafters.weight_storage): Linear weights in it, norms in bf16."""
    c = parameter_counts(config)
    hidden, hd = config.hidden_size, config.head_dim
    rows = hidden + config.num_hidden_layers * (  # output rows of the Linear weights: fc, then q k v o, gate up down
        hd * (config.num_attention_heads + 2 * config.num_key_value_heads) + hidden
        + 2 * config.intermediate_size + hidden)
    return linear_bytes(c["total"] - c["norms"], rows, storage) + 2 * c["norms"]

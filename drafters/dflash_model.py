"""The DFlash draft network and its checkpoint format (z-lab's `DFlashDraftModel`).

Checkpoint: `config.json` (a qwen3 layer config plus `block_size`, `num_target_layers` and
`dflash_config: {target_layer_ids, mask_token_id}`) and safetensors weights named `fc`,
`hidden_norm`, `norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`, `.{q,k}_norm`,
`.mlp.{gate,up,down}_proj`, `.input_layernorm`, `.post_attention_layernorm`. No embeddings and
no lm_head: the drafter uses the target's.

Per draft layer, queries come from the block only; keys/values are [projected context ; block]
where the projected context `hidden_norm(fc(concat(target features)))` goes straight into the
k/v projections (no input_layernorm, no MLP). RoPE at absolute positions; attention is non-causal.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config

from drafters import weight_storage
from specdec.models.decoder import ArchitectureTraits, DecoderLayer
from specdec.models.layers import RMSNorm, RotaryEmbedding, use_fused_kernels
from specdec.models.loader import read_json_object

WEIGHTS_FILE = "model.safetensors"
# a step drafts block_size - 1 tokens and the target verifies up to block_size per request: beyond this a
# block only costs (the drafter's acceptance is nil that deep) and its buffers grow with it
MAX_BLOCK_SIZE = 64


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread from layer 1 to num_target_layers - 3 (z-lab's default)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DFlashSpec:
    """The DFlash-specific fields of a drafter config, with z-lab's lookup rules."""

    block_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # how far back its attention was trained to reach (the longest training sequence; 0: not declared): the
    # engine's default `draft_window` for it
    draft_window: int = 0
    # the blocks it was trained to draft with, block_size among them (its trainer's `block_sizes`): a draft step
    # scoring n drafts runs the shortest of them that holds the anchor and n masks. A drafter trained on whole
    # blocks only drafts badly from shorter ones (BENCHMARKS.md), so by default it gets whole blocks
    block_sizes: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.block_sizes:
            object.__setattr__(self, "block_sizes", (self.block_size,))

    def block_for(self, drafts: int) -> int:
        """The block a step scoring `drafts` drafts runs: the shortest trained one of at least drafts + 1."""
        return min(size for size in self.block_sizes if size > drafts)

    @classmethod
    def from_config(cls, config) -> "DFlashSpec":
        extra = getattr(config, "dflash_config", None) or {}

        def value(name, default=None):  # dflash_config wins over the top level
            return extra.get(name, getattr(config, name, default))

        num_target_layers = getattr(config, "num_target_layers", None)
        if num_target_layers is None:
            raise ValueError("the drafter config has no num_target_layers")
        mask = value("mask_token_id")
        if mask is None:
            raise ValueError("the drafter config has no dflash_config.mask_token_id")
        ids = value("target_layer_ids") or default_target_layer_ids(num_target_layers, config.num_hidden_layers)
        block = value("block_size", 16)
        if not (isinstance(block, int) and not isinstance(block, bool) and 2 <= block <= MAX_BLOCK_SIZE):
            raise ValueError(f"the drafter config's block_size must be an integer in [2, {MAX_BLOCK_SIZE}] (a step "
                             f"drafts block_size - 1 tokens), got {block!r}")
        window = value("draft_window", 0)
        if not (isinstance(window, int) and not isinstance(window, bool) and window >= 0):
            raise ValueError(f"the drafter config's draft_window must be a non-negative integer (0: none), got "
                             f"{window!r}")
        sizes = value("block_sizes") or [block]
        if not (isinstance(sizes, (list, tuple)) and block in sizes
                and all(isinstance(n, int) and not isinstance(n, bool) and 2 <= n <= block for n in sizes)):
            raise ValueError(f"the drafter config's block_sizes must list integers in [2, block_size] with block_size "
                             f"({block}) among them, got {sizes!r}")
        return cls(int(block), int(num_target_layers), tuple(int(i) for i in ids), int(mask),
                   float(value("input_embedding_scale", 1.0)), float(value("output_multiplier", 1.0)),
                   value("final_logit_softcapping"), window, tuple(sorted(set(sizes))))


def dflash_layer(config) -> DecoderLayer:
    """A draft layer: the shared pre-norm decoder layer with Qwen3's q/k norm (biases per the config)."""
    bias = bool(getattr(config, "attention_bias", False))
    return DecoderLayer(config, ArchitectureTraits(qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False))


class DFlashDraftModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.spec = DFlashSpec.from_config(config)
        hidden = config.hidden_size
        self.layers = nn.ModuleList(dflash_layer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.spec.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.head_dim = self.layers[0].self_attn.head_dim
        with torch.device("cpu"):  # computed, never loaded
            self.rotary = RotaryEmbedding(config, self.head_dim)

    fused_kernels = False

    def use_fused_kernels(self) -> None:
        use_fused_kernels(self)
        self.fused_kernels = True

    def project_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [n, len(ids) * hidden] -> the context stream [n, hidden]."""
        return self.hidden_norm(self.fc(target_features))

    def block_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Logits in the model dtype (fp32 once a multiplier or soft-capping applies): the argmax of a
        bf16 matmul's output equals that of its fp32 cast, and the smaller buffer halves the traffic."""
        logits = lm_head(self.norm(hidden))
        cap = self.spec.final_logit_softcapping
        if self.spec.output_multiplier != 1.0 or cap:
            logits = logits.float() * self.spec.output_multiplier
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def read_dflash_config(path: str | os.PathLike):
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} is not a DFlash drafter directory: no config.json")
    raw = read_json_object(config_file, "the drafter's JSON config")
    if "DFlashDraftModel" not in (raw.get("architectures") or []):
        raise ValueError(f"{config_file} does not describe a DFlashDraftModel (architectures: "
                         f"{raw.get('architectures')})")
    try:
        config = Qwen3Config.from_dict(raw)  # the layer config is qwen3; extra DFlash fields are kept as attributes
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a malformed config
        raise ValueError(f"{config_file} is not a valid drafter config: {type(err).__name__}: {err}") from err
    try:
        DFlashSpec.from_config(config)  # the DFlash fields, checked here so that the message names the file
    except (ValueError, TypeError) as err:
        raise ValueError(f"{config_file}: {err}") from err
    return config


def load_dflash(path: str | os.PathLike, device: torch.device, dtype: torch.dtype) -> DFlashDraftModel:
    config = read_dflash_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    state = {}
    for f in files:
        try:
            state.update(load_file(f, device=str(device)))
        except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
            raise ValueError(f"cannot read the drafter weights {f}: {err}; the file may be truncated or corrupt: "
                             f"copy or export it again") from err
    state = weight_storage.dequantize(state, getattr(config, weight_storage.STORAGE_KEY, None), str(path))
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as err:  # sizes in config.json that are not the weights' own
        raise ValueError(f"the drafter weights in {path} do not match its config.json: "
                         f"{str(err).splitlines()[-1].strip()}; the config and the weights must come from the same "
                         f"export") from err
    if missing or unexpected:
        raise ValueError(f"drafter weights in {path} do not match the DFlash format: "
                         f"missing {sorted(missing)[:6]}, unexpected {sorted(unexpected)[:6]}")
    model.rotary.to(device)
    return model.to(dtype).eval().requires_grad_(False)


def save_dflash(model: DFlashDraftModel, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                storage: str = "bf16") -> None:
    """Write the z-lab checkpoint format: config.json + model.safetensors.

    Another `storage` than bf16 (`drafters.weight_storage.STORAGES`) writes a compact variant instead;
    only `load_dflash` reads those."""
    marker = weight_storage.config_value(storage)  # refuses an unknown storage before anything is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop(weight_storage.STORAGE_KEY, None)
    config["architectures"] = ["DFlashDraftModel"]
    config["model_type"] = "qwen3"
    spec = model.spec
    config["block_size"] = spec.block_size
    config["num_target_layers"] = spec.num_target_layers
    config["dflash_config"] = {**(config.get("dflash_config") or {}), "target_layer_ids": list(spec.target_layer_ids),
                               "mask_token_id": spec.mask_token_id, "block_size": spec.block_size}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if marker is None:
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    else:
        config[weight_storage.STORAGE_KEY] = marker
        linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        state = weight_storage.quantize(model.state_dict(), linear, storage)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})

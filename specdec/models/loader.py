"""Load a target model and its tokenizer from an HF model directory (`specdec.weights` turns demo names
and GGUF files into one)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from specdec.models.decoder import SUPPORTED_MODEL_TYPES, CausalLM
from specdec.models.kv_scales import KVScales, read_kv_scales

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _has_file(directory, patterns) -> bool:
    return any(next(Path(directory).glob(pattern), None) is not None for pattern in patterns)


@dataclass
class LoadedTarget:
    model: CausalLM
    tokenizer: object
    eos_token_ids: frozenset[int]
    path: Path
    kv_scales: KVScales | None = None  # FP8 KV scales the checkpoint carries
    cache_dir: Path | None = None  # where facts measured on this model may be kept (None: nowhere)


# sizes every supported architecture has, each a positive integer
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings")


def read_json_object(file: Path, what: str) -> dict:
    """A JSON file's object; ValueError naming the file and `what` it must be when it is unreadable or no object."""
    try:
        raw = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {file}: {err}; it must be {what}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(raw).__name__}; it must be {what}")
    return raw


def read_config(model_dir: Path):
    config_file = Path(model_dir) / "config.json"
    read_json_object(config_file, "the model's JSON config")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a malformed config
        raise ValueError(f"{config_file} is not a valid model config: {type(err).__name__}: {err}") from err
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {config.model_type!r} ({', '.join(config.architectures or [])}) in {model_dir}; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    sizes = {name: getattr(config, name, None) for name in SIZE_FIELDS}
    bad = [f"{name}={value!r}" for name, value in sizes.items()
           if isinstance(value, bool) or not isinstance(value, int) or value <= 0]
    if bad:
        raise ValueError(f"{config_file}: {', '.join(bad)}: each must be a positive integer; fix the config")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"{config_file}: num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                         f"num_key_value_heads ({config.num_key_value_heads}); fix the config")
    return config


def load_causal_lm(model_dir: Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    config = read_config(model_dir)
    # transformers reads the checkpoint (sharding, renames); its tensors are then adopted without a copy
    if not _has_file(model_dir, WEIGHT_FILES):
        raise ValueError(f"{model_dir} has a config.json but no weights ({' or '.join(WEIGHT_FILES)}); "
                         f"copy the model's weight files into it")
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device},
                                                        output_loading_info=True)
    except Exception as err:  # safetensors raises its own error type for truncated or corrupt files
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        if any(sign in str(err) for sign in ("size mismatch", "ignore_mismatched_sizes", "shape")):
            raise ValueError(f"the weights in {model_dir} do not match its config.json: {first}; the config and "
                             f"the weight files must come from the same model") from err
        raise ValueError(f"cannot read the model weights in {model_dir}: {first}; the files may be truncated "
                         f"or corrupt: download them again") from err
    # a parameter the checkpoint lacks would be left at a random init: the model would answer garbage
    missing = sorted(set(info.get("missing_keys") or ()) | set(info.get("mismatched_keys") or ()))
    if missing:
        raise ValueError(f"the weights in {model_dir} lack {len(missing)} of the model's parameters "
                         f"({', '.join(map(str, missing[:4]))}{', ...' if len(missing) > 4 else ''}); copy the "
                         f"model's complete weight files")
    state = hf.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = CausalLM(config)
    model.load_state_dict(state, strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary.to(device)
    del hf
    return model.eval().requires_grad_(False)


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_target(model_dir: Path, device: torch.device, dtype: torch.dtype) -> LoadedTarget:
    read_config(model_dir)  # a broken config is reported as one, not as the tokenizer's failure to read it
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, device, dtype)
    return LoadedTarget(model, tokenizer, eos_token_ids(model_dir, tokenizer), model_dir,
                        read_kv_scales(model_dir, model.config.num_hidden_layers))


def load_tokenizer(model_dir: Path):
    """The model's own tokenizer. Without tokenizer files transformers would quietly substitute a tiny
    one (every prompt encoding to nothing), so their absence is an error."""
    if not _has_file(model_dir, TOKENIZER_FILES):
        raise ValueError(f"{model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); copy the model's "
                         f"tokenizer into it, or pass token ids instead of text to the library")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the tokenizer in {model_dir}: {str(err).splitlines()[0]}") from err

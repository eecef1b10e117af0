"""Checks, before any generation, that a DFlash drafter fits its target; each error names both values."""

from __future__ import annotations

from drafters.dflash_model import DFlashSpec


def check_compatible(draft_config, target_config, where: str = "the drafter") -> DFlashSpec:
    spec = DFlashSpec.from_config(draft_config)
    problems = []
    if draft_config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {draft_config.hidden_size} != the target's {target_config.hidden_size}")
    if draft_config.num_attention_heads % draft_config.num_key_value_heads:
        problems.append(f"num_attention_heads {draft_config.num_attention_heads} is not a multiple of "
                        f"num_key_value_heads {draft_config.num_key_value_heads}")
    head_dim = getattr(draft_config, "head_dim", None) or draft_config.hidden_size // draft_config.num_attention_heads
    if head_dim % 2:
        problems.append(f"head_dim {head_dim} must be even for RoPE")
    layers = target_config.num_hidden_layers
    if spec.num_target_layers != layers:
        problems.append(f"num_target_layers {spec.num_target_layers} != the target's {layers} layers")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < layers]
    if bad:
        problems.append(f"target_layer_ids {list(spec.target_layer_ids)} has {bad} outside 0..{layers - 1}")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        problems.append(f"mask_token_id {spec.mask_token_id} is outside the target's embedding "
                        f"(vocab_size {target_config.vocab_size})")
    draft_vocab = getattr(draft_config, "vocab_size", None)
    if draft_vocab is not None and draft_vocab != target_config.vocab_size:
        problems.append(f"vocab_size {draft_vocab} != the target's {target_config.vocab_size} "
                        f"(the drafter was trained for another tokenizer)")
    if spec.block_size < 2:
        problems.append(f"block_size {spec.block_size} must be >= 2")
    if problems:
        raise ValueError(f"drafter {where} does not fit the target: " + "; ".join(problems))
    return spec

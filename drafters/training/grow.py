"""A trained drafter made larger without changing what it computes, so that training goes on from
where it was with more capacity instead of starting over.

    more draft layers      appended, fresh weights, with o_proj and down_proj zero: both residual
                           branches add nothing, so each new layer starts as the identity
    a wider MLP            fresh gate/up rows, zero down_proj columns: the new units add nothing
    more target layers     the fc columns reading the new layers' features are zero

Gradients reach every new weight from the first step (the zero matrices get a gradient through the
nonzero inputs they multiply; the rest once those have moved), as in function-preserving network growth.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from drafters.dflash_model import DFlashDraftModel
from drafters.training.drafter_config import DrafterShape, drafter_config, new_drafter


def shape_of(drafter: DFlashDraftModel) -> DrafterShape:
    c = drafter.config
    return DrafterShape(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                        c.intermediate_size, drafter.spec.block_size, tuple(drafter.spec.target_layer_ids))


def check_growable(old: DrafterShape, new: DrafterShape) -> None:
    problems = []
    for field in ("heads", "kv_heads", "head_dim", "block_size"):
        if getattr(old, field) != getattr(new, field):
            problems.append(f"{field} {getattr(new, field)} != the drafter's {getattr(old, field)} (must stay)")
    for field in ("num_layers", "intermediate_size"):
        if getattr(new, field) < getattr(old, field):
            problems.append(f"{field} {getattr(new, field)} < the drafter's {getattr(old, field)} (can only grow)")
    missing = sorted(set(old.target_layer_ids) - set(new.target_layer_ids))
    if missing:
        problems.append(f"target layer ids {list(new.target_layer_ids)} drop the drafter's {missing} "
                        f"(give a superset of {list(old.target_layer_ids)})")
    if problems:
        raise ValueError("cannot grow the drafter to this shape: " + "; ".join(problems))


def grow(drafter: DFlashDraftModel, target_config, shape: DrafterShape, seed: int = 0) -> DFlashDraftModel:
    """A float32 drafter of `shape` computing exactly what `drafter` computes (same mask token). Target
    layer ids None: the drafter's own."""
    old_shape = shape_of(drafter)
    if shape.target_layer_ids is None:
        shape = replace(shape, target_layer_ids=old_shape.target_layer_ids)
    check_growable(old_shape, shape)
    grown = new_drafter(drafter_config(target_config, shape, drafter.spec.mask_token_id), seed)
    state = grown.state_dict()
    hidden = drafter.config.hidden_size
    old_width = old_shape.intermediate_size
    with torch.no_grad():
        for name, value in drafter.state_dict().items():
            value = value.float()
            if name == "fc.weight":
                state[name].zero_()
                for j, layer_id in enumerate(old_shape.target_layer_ids):
                    p = shape.target_layer_ids.index(layer_id)
                    state[name][:, p * hidden:(p + 1) * hidden] = value[:, j * hidden:(j + 1) * hidden]
            elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                state[name][:old_width] = value
            elif name.endswith("mlp.down_proj.weight"):
                state[name][:, :old_width] = value
                state[name][:, old_width:] = 0
            else:
                state[name].copy_(value)
        for name in state:
            layer = re.match(r"layers\.(\d+)\.", name)
            if layer and int(layer[1]) >= old_shape.num_layers and name.endswith(
                    ("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                state[name].zero_()
    grown.load_state_dict(state)
    return grown

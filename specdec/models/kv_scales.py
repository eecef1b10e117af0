"""FP8 KV cache scales that a checkpoint carries (vLLM and llm-compressor names).

    scales = read_kv_scales(model_dir, num_layers)    # KVScales, or None when the checkpoint has none

Names read, per decoder layer i: `model.layers.{i}.self_attn.k_scale` / `v_scale` (llm-compressor,
vLLM), `model.layers.{i}.self_attn.kv_scale` (one scale for both, older checkpoints) and
`model.layers.{i}.self_attn.{k,v}_proj.output_scale`. A per-head scale (one per KV head) becomes its
largest head's, since the cache keeps one scale per layer: no value of any head then saturates.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                   r"v_proj\.output_scale)$")
_SETS = {"k_scale": ("k",), "k_proj.output_scale": ("k",), "v_scale": ("v",), "v_proj.output_scale": ("v",),
         "kv_scale": ("k", "v")}  # which scales a name gives


@dataclass(frozen=True)
class KVScales:
    k: tuple[float, ...]  # one per layer
    v: tuple[float, ...]


def read_kv_scales(model_dir: Path, num_layers: int) -> KVScales | None:
    """The checkpoint's K and V scales for every layer; None if it carries none. A checkpoint with scales
    for only some layers, or non-positive ones, is an error (its quantized values cannot be read right)."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                match = _NAME.match(key)
                if match is None:
                    continue
                layer, value = int(match.group(1)), float(f.get_tensor(key).float().max())
                for which in _SETS[match.group(2)]:
                    found[which][layer] = value
    if not found["k"] and not found["v"]:
        return None
    for which, scales in found.items():
        missing = sorted(set(range(num_layers)) - set(scales))
        if missing:
            raise ValueError(f"{model_dir} has FP8 KV scales for some layers but no {which}_scale for layers "
                             f"{missing}; give every layer its scales or none")
        if any(s <= 0 for s in scales.values()):
            raise ValueError(f"{model_dir} has a non-positive {which}_scale: {min(scales.values())}")
    return KVScales(tuple(found["k"][i] for i in range(num_layers)), tuple(found["v"][i] for i in range(num_layers)))

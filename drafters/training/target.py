"""The frozen target during training: hidden features of chosen layers, embeddings and lm_head.

Loaded with transformers. Feature "layer id i" is the output of decoder layer i, HF's
`hidden_states[i + 1]`, the same tensor the inference engine hands the drafter. Layers past the
deepest one needed are dropped (one is kept beyond it: transformers replaces the last recorded
hidden state with the final norm's output).
"""

from __future__ import annotations

import os
import re

import torch
from transformers import AutoModelForCausalLM


class FrozenTarget:
    def __init__(self, model, layer_ids):
        self.config = model.config
        self.layer_ids = tuple(int(i) for i in layer_ids)
        layers = self.config.num_hidden_layers
        deepest = max(self.layer_ids)
        if min(self.layer_ids) < 0 or deepest >= layers - 1:
            raise ValueError(f"target layer ids {list(self.layer_ids)} must lie in 0..{layers - 2}: transformers "
                             f"reports the last layer ({layers - 1}) after the final norm")
        self.model = model.eval().requires_grad_(False)
        decoder = model.base_model
        decoder.layers = decoder.layers[:min(layers, deepest + 2)]
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.device = self.lm_head.weight.device

    @classmethod
    def load(cls, name_or_path: str | os.PathLike, layer_ids, device: torch.device, dtype: torch.dtype):
        from specdec.weights.demo_models import resolve_model

        model = AutoModelForCausalLM.from_pretrained(resolve_model(name_or_path), dtype=dtype)
        return cls(model.to(device), layer_ids)

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (right-padded) -> [B, L, len(layer_ids) * hidden], the target's dtype."""
        out = self.model.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)


def check_mask_token(mask_token_id: int, vocab_size: int, tokenizer=None) -> None:
    """The mask token must be an embedding row that no text ever produces.

    Unused rows are those past the tokenizer (len(tokenizer) <= id < vocab_size). A tokenizer
    converted from GGUF lists those rows too, as placeholders named `[PAD<id>]`; they count as unused."""
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask token id {mask_token_id} is outside the target's embedding (vocab_size {vocab_size})")
    if tokenizer is None or mask_token_id >= len(tokenizer):
        return
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    if not re.fullmatch(rf"\[PAD{mask_token_id}\]", str(token)):
        raise ValueError(f"mask token id {mask_token_id} is a real token of the tokenizer ({token!r}); pick an "
                         f"unused row in {len(tokenizer)}..{vocab_size - 1}")

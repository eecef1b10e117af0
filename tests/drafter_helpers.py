"""Random DFlash drafters in the z-lab format, and test drafters with known behaviour."""

from __future__ import annotations

import torch
from transformers import Qwen3Config

from drafters.base import Drafter
from drafters.dflash_model import DFlashDraftModel, save_dflash


def dflash_config(target_config, block_size=4, num_layers=2, target_layer_ids=None, mask_token_id=None,
                  heads=4, kv_heads=2, head_dim=16, intermediate_size=96):
    config = Qwen3Config(vocab_size=target_config.vocab_size, hidden_size=target_config.hidden_size,
                         intermediate_size=intermediate_size, num_hidden_layers=num_layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                         tie_word_embeddings=False)
    config.architectures = ["DFlashDraftModel"]
    config.num_target_layers = target_config.num_hidden_layers
    config.block_size = block_size
    dflash = {"mask_token_id": target_config.vocab_size - 1 if mask_token_id is None else mask_token_id}
    if target_layer_ids is not None:
        dflash["target_layer_ids"] = list(target_layer_ids)
    config.dflash_config = dflash
    return config


def build_random_drafter(path, target_config, seed=0, dtype=torch.float32, std=0.2, **kwargs) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(dflash_config(target_config, **kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    save_dflash(model, path, dtype=dtype)
    return model


class ScriptedDrafter(Drafter):
    """Proposes from a known continuation of each prompt: `script(request) -> list of tokens`.

    With the target's own greedy continuation every draft is accepted (tau = block_size); with
    `wrong=True` every draft differs from it (tau = 1)."""

    def __init__(self, continuations: dict[tuple, list[int]], block_size: int, vocab: int, wrong=False,
                 error_rate=0.0, seed=0):
        self.continuations = continuations
        self.block_size = block_size
        self.vocab = vocab
        self.wrong = wrong
        self.error_rate = error_rate  # each draft is independently corrupted with this probability
        self.rng = torch.Generator().manual_seed(seed)
        self.target_layer_ids = (0,)
        self.live: set[int] = set()

    def attach(self, engine):
        self.device = engine.device

    def add_context(self, requests, features):
        self.live.update(r.request_id for r in requests)

    def extend(self, requests, features, rows, counts):
        assert all(r.request_id in self.live for r in requests)

    def release(self, request):
        self.live.discard(request.request_id)

    def propose(self, requests):
        rows = []
        for r in requests:
            cont = self.continuations[tuple(r.prompt_ids)]
            n = len(r.output_ids)
            nxt = (cont[n:n + self.block_size - 1] + [3] * self.block_size)[:self.block_size - 1]
            corrupt = torch.rand(len(nxt), generator=self.rng) < self.error_rate
            rows.append([(t + 1) % self.vocab if self.wrong or c else t for t, c in zip(nxt, corrupt.tolist())])
        return torch.tensor(rows, dtype=torch.long, device=self.device)

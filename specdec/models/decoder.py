"""One decoder for the Llama / Qwen2 / Qwen3 family over a flattened batch of tokens.

Module and parameter names follow transformers (`model.layers.{i}.self_attn.q_proj`, ...), so an
HF state dict loads as is. Attention goes through a planned `AttentionBackend` over a paged
`KVCache`; the caller plans the step (one plan for all layers) before calling `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from attention.backend import AttentionBackend
from attention.kv_cache import KVCache
from specdec.models.layers import AttentionProjections, GatedMLP, RMSNorm, Rope, RotaryEmbedding, use_fused_kernels


@dataclass(frozen=True)
class ArchitectureTraits:
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool


def architecture_traits(config) -> ArchitectureTraits:
    model_type = config.model_type
    if model_type == "llama":
        bias = bool(getattr(config, "attention_bias", False))
        return ArchitectureTraits(bias, bias, False, bool(getattr(config, "mlp_bias", False)))
    if model_type == "qwen2":
        return ArchitectureTraits(True, False, False, False)
    if model_type == "qwen3":
        bias = bool(getattr(config, "attention_bias", False))
        return ArchitectureTraits(bias, bias, True, False)
    raise ValueError(f"unsupported architecture {model_type!r}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [len(logits_rows), vocab] in the model dtype (fp32 on CPU)
    features: torch.Tensor | None  # [tokens, len(feature_layers) * hidden]: outputs of the chosen layers


Attention = Callable[[AttentionProjections, torch.Tensor], torch.Tensor]
LayerAttention = Callable[[int, Rope], Attention]  # (layer index, the forward's RoPE) -> that layer's attention


class DecoderLayer(nn.Module):
    """The one pre-norm decoder layer: the target's layers, the DFlash drafter's, and the drafter's
    training forward all run through it; they differ only in what `attention` does."""

    def __init__(self, config, traits: ArchitectureTraits):
        super().__init__()
        self.self_attn = AttentionProjections(config, traits.qkv_bias, traits.o_bias, traits.qk_norm)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, traits.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, attention: Attention):
        """Pre-norm block on a residual stream: returns (this layer's delta, the stream before it);
        the layer's output is their sum (the fused add+norm of the next layer adds them).
        attention(self_attn, normed x) -> attention output [tokens, heads, head_dim], before o_proj."""
        h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(self.self_attn.output(attention(self.self_attn, h)),
                                                                 residual)
        return self.mlp(h), residual


def paged_attention(rope: Rope, layer_kv, backend: AttentionBackend) -> Attention:
    """Self-attention of the step's tokens over the paged cache (their K/V are written first)."""

    def attend(projections: AttentionProjections, h: torch.Tensor) -> torch.Tensor:
        q, k, v = projections.project(h, rope)
        backend.write_kv(layer_kv, k, v)
        return backend.attend(q, layer_kv)

    return attend


class DecoderBody(nn.Module):
    def __init__(self, config, traits: ArchitectureTraits):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, traits) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama/Qwen2/Qwen3 causal LM. `features` are decoder-layer outputs (DFlash's 'layer id i')."""

    def __init__(self, config):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported; set use_sliding_window=false")
        self.config = config
        self.traits = architecture_traits(config)
        self.model = DecoderBody(config, self.traits)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.head_dim = self.model.layers[0].self_attn.head_dim
        with torch.device("cpu"):  # frequencies are computed, never loaded: real even when the rest is meta
            self.rotary = RotaryEmbedding(config, self.head_dim)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    fused_kernels = False

    def use_fused_kernels(self) -> None:
        """FlashInfer norms, RoPE and activation, fused q/k/v and gate/up GEMMs (CUDA inference)."""
        use_fused_kernels(self)
        self.fused_kernels = True

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states -> logits in the model dtype (a later cast to fp32 is exact), written
        into `out` when given (a CUDA graph's static output)."""
        if out is None:
            return self.lm_head(hidden)
        return torch.matmul(hidden, self.lm_head.weight.t(), out=out)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn: AttentionBackend,
        *,
        logits_rows: torch.Tensor | slice | None = None,
        feature_layers: tuple[int, ...] = (),
        logits_out: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """input_ids, positions: [tokens] in the planned layout's order.

        logits_rows: which token rows get logits (None: none; a slice or an index tensor).
        feature_layers: decoder layers whose outputs are returned, concatenated on the last dim, for
        every token. logits_out: a buffer the logits are written into.
        """
        hidden, features = self.hidden_states(
            input_ids, positions, lambda i, rope: paged_attention(rope, kv_cache.layers[i], attn),
            feature_layers=feature_layers)
        logits = None if logits_rows is None else self.logits(hidden[logits_rows], logits_out)
        return ForwardOutput(logits, features)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention, *,
                      feature_layers: tuple[int, ...] = (), features_out: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-normed hidden states of every token, and the outputs of `feature_layers` (written into
        `features_out` when given: a CUDA graph's static buffer). attention(i, rope) is layer i's
        attention (the paged one in `forward`; a piecewise CUDA graph cuts the forward there)."""
        x = self.embed(input_ids)
        rope = self.rotary.at(positions, x.dtype, fused=self.fused_kernels)
        wanted = {layer: None for layer in feature_layers}
        residual = None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, attention(i, rope))
            if i in wanted:
                wanted[i] = x + residual  # the output of decoder layer i
        features = None
        if feature_layers:
            features = torch.cat([wanted[i] for i in feature_layers], dim=-1, out=features_out)
        return self.model.norm.add_and_norm(x, residual)[0], features

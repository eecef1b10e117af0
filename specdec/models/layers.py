"""Building blocks shared by the target decoder and the DFlash drafter.

Two kernel paths with one set of weights: plain torch (CPU, the reference, and training: it has
autograd), and FlashInfer's fused kernels on CUDA (norms, add+norm, RoPE, SiLU-and-mul) after
`use_fused_kernels(module)`, which also fuses q/k/v and gate/up into single GEMMs by making the
original weights views of one concatenated tensor (parameter names stay those of transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# rope types whose frequencies do not depend on the sequence length (so positions fully decide them)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, as transformers does."""

    fused = False  # FlashInfer kernel (inference on CUDA only)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            import flashinfer

            return flashinfer.rmsnorm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); a None residual (the first layer) adds nothing.
        The fused kernel reuses both buffers in place."""
        if residual is None:
            return self(x), x
        if self.fused:
            import flashinfer

            flashinfer.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        residual = x + residual
        return self(residual), residual


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, frequencies from the HF config's rope parameters."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        params = config.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
        if rope_type == "default":
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)
        self.max_positions = config.max_position_embeddings

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def cos_sin_cache(self, max_positions: int) -> torch.Tensor:
        """FlashInfer's table: [max_positions, head_dim] fp32, cos in the first half, sin in the second."""
        cache = getattr(self, "_cos_sin_cache", None)
        if cache is None or cache.shape[0] < max_positions:
            freqs = torch.arange(max_positions, device=self.inv_freq.device).float()[:, None] * self.inv_freq[None]
            cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling
            self._cos_sin_cache = cache
        return cache

    def at(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool = False) -> "Rope":
        return Rope(self, positions, dtype, fused)


class Rope:
    """RoPE at the positions of one forward: torch cos/sin tables, or FlashInfer's fused kernel."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype, fused: bool):
        self.rotary, self.positions, self.dtype, self.fused = rotary, positions, dtype, fused
        self._tables = None

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rotary(self.positions, self.dtype)
        return self._tables

    def pair(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [n, hq, d] and k [n, hk, d] (in place on the fused path)."""
        if self.fused:
            import flashinfer

            cache = self.rotary.cos_sin_cache(self.rotary.max_positions)
            flashinfer.apply_rope_with_cos_sin_cache_inplace(self.positions, q, k, q.shape[-1], cache, is_neox=True)
            return q, k
        cos, sin = self.tables
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def single(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.tables
        return apply_rope(x, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linears on the same input; each Linear keeps a view of it."""
    weight = torch.cat([m.weight.data for m in linears])
    bias = torch.cat([m.bias.data for m in linears]) if linears[0].bias is not None else None
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return weight, bias


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_name = act
        self.act = ACT2FN[act]
        self.gate_up = None  # (weight, bias) after fusing

    def fuse(self) -> None:
        if self.act_name == "silu":
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            import flashinfer

            return self.down_proj(flashinfer.silu_and_mul(F.linear(x, *self.gate_up)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """q/k/v/o projections plus the optional per-head q/k RMSNorm (Qwen3, DFlash)."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

        self.qkv_fused = None  # (weight, bias) of q|k|v after fusing
        self.kv_fused = None  # the k|v rows of it (a view), for inputs that need no query

    def fuse(self) -> None:
        weight, bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)
        self.qkv_fused = (weight, bias)
        nq = self.num_heads * self.head_dim
        self.kv_fused = (weight[nq:], None if bias is None else bias[nq:])

    def _split_heads(self, out: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
        parts = out.split([c * self.head_dim for c in counts], dim=-1)
        return [p.view(out.shape[0], c, self.head_dim) for p, c in zip(parts, counts)]

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [n, heads, head_dim] with q/k norm and RoPE, for tokens that attend and are attended."""
        if self.qkv_fused is not None:
            q, k, v = self._split_heads(F.linear(x, *self.qkv_fused),
                                        [self.num_heads, self.num_kv_heads, self.num_kv_heads])
        else:
            n = x.shape[0]
            q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.pair(q, k)
        return q, k, v

    def project_kv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v only (the DFlash context): one GEMM over the fused k|v rows when available."""
        if self.kv_fused is not None:
            k, v = self._split_heads(F.linear(x, *self.kv_fused), [self.num_kv_heads, self.num_kv_heads])
        else:
            n = x.shape[0]
            k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return rope.single(k), v

    def output(self, attn_out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn_out.reshape(attn_out.shape[0], -1))


def use_fused_kernels(module: nn.Module) -> None:
    """Switch an inference module to FlashInfer's fused kernels (CUDA, no autograd)."""
    for m in module.modules():
        if isinstance(m, RMSNorm):
            m.fused = True
        elif isinstance(m, (GatedMLP, AttentionProjections)):
            m.fuse()

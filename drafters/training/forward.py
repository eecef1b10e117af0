"""Dense training forward of `DFlashDraftModel` over many blocks per sequence, and the loss.

Per draft layer, with the model's own submodules (so training and inference share weights):

    queries   block tokens: input_layernorm -> q_proj -> q_norm -> RoPE at anchor + k
    keys/vals [context ; blocks]: k/v_proj of ctx = hidden_norm(fc(features)) with RoPE at the
              context positions (no input_layernorm, no MLP), then k/v_proj of the normed block
              tokens with RoPE at their block positions
    attention SDPA with `training_mask` (each block sees context < anchor and itself)

then o_proj + residual, post_attention_layernorm + MLP + residual; the final `norm` and the target's
lm_head give logits. With one anchor whose context is the whole prefix this is exactly the
inference drafter's computation.

The cross-entropy runs in row chunks with the gradient computed in the same pass, so the
[rows, vocab] logits never exist whole and the lm_head matmul runs twice per chunk, not three times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafters.dflash_model import DFlashDraftModel
from drafters.training.anchors import IGNORE
from drafters.training.mask import training_mask


def block_hidden(model: DFlashDraftModel, features: torch.Tensor, block_embeds: torch.Tensor,
                 anchor_positions: torch.Tensor, block_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """features [B, L, F] (target features of every position), block_embeds [B, A, bs, hidden]
    (target embeddings of the block tokens), anchor_positions [B, A] (block_sizes [B, A]: each block's size,
    `training_mask`) -> final hidden states [B, A, bs, hidden] (before the final norm)."""
    b, ctx_len, _ = features.shape
    _, a, bs, hidden = block_embeds.shape
    q_len = a * bs
    dtype, dev = model.fc.weight.dtype, features.device
    ctx = model.project_context(features.to(dtype)).reshape(b * ctx_len, hidden)
    x = block_embeds.to(dtype).reshape(b, q_len, hidden) * model.spec.input_embedding_scale
    ctx_rope = model.rotary.at(torch.arange(ctx_len, device=dev).repeat(b), dtype)
    blk_rope = model.rotary.at((anchor_positions[..., None] + torch.arange(bs, device=dev)).flatten(), dtype)
    mask = training_mask(anchor_positions, ctx_len, bs, block_sizes)

    def attend(attn, h):  # block queries over [context ; blocks] under the training mask
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, k_blk, v_blk = attn.project(h, blk_rope)
        k_ctx, v_ctx = attn.project_kv(ctx, ctx_rope)
        q = q.view(b, q_len, nh, hd).transpose(1, 2)
        k = torch.cat([k_ctx.view(b, ctx_len, nkv, hd), k_blk.view(b, q_len, nkv, hd)], dim=1)
        v = torch.cat([v_ctx.view(b, ctx_len, nkv, hd), v_blk.view(b, q_len, nkv, hd)], dim=1)
        k = k.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=hd ** -0.5)
        return out.transpose(1, 2).reshape(b * q_len, nh, hd)

    x = x.reshape(b * q_len, hidden)
    residual = None
    for layer in model.layers:  # the shared pre-norm layer (specdec.models.decoder.DecoderLayer)
        x, residual = layer(x, residual, attend)
    return (x + residual).view(b, a, bs, hidden)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(multiplier * lm_head(h_i), label_i) and argmax_i == label_i, in row chunks.

    The gradient w.r.t. h is computed in the forward pass (the lm_head is frozen), so backward is
    one multiply. Per chunk the [rows, vocab] work is one softmax (fp32 out) and one cast back; the
    row weights are applied after the matmul, on [rows, hidden]. The loss reads -log p[label] from
    that softmax, so one token's loss is capped at -log(1e-38) ~ 87.5 (its gradient is exact)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, weights, multiplier: float, chunk: int):
        wants_grad = hidden.requires_grad
        grad = torch.empty_like(hidden) if wants_grad else None
        total = torch.zeros((), dtype=torch.float, device=hidden.device)
        correct = torch.empty(hidden.shape[0], dtype=torch.bool, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly below
            for s in range(0, hidden.shape[0], chunk):
                h, y, w = hidden[s:s + chunk], labels[s:s + chunk], weights[s:s + chunk].float()
                logits = F.linear(h.to(weight.dtype), weight, bias)
                if multiplier != 1.0:
                    logits = logits * multiplier
                correct[s:s + chunk] = logits.argmax(-1) == y
                p = torch.softmax(logits, dim=-1, dtype=torch.float)
                del logits
                p_label = p.gather(1, y[:, None]).squeeze(1)
                total += (-p_label.clamp_min(1e-38).log() * w).sum()
                if wants_grad:
                    p[torch.arange(len(y), device=y.device), y] -= 1.0  # d CE / d logits = p - onehot
                    g = (p.to(weight.dtype) @ weight).float() * (w * multiplier)[:, None]
                    grad[s:s + chunk] = g.to(grad.dtype)
        ctx.save_for_backward(grad if wants_grad else torch.empty(0))
        ctx.mark_non_differentiable(correct)
        return total, correct

    @staticmethod
    def backward(ctx, grad_total, grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_total.to(grad.dtype), None, None, None, None, None, None


@dataclass
class BlockLoss:
    loss: torch.Tensor  # scalar: sum(w * CE) / sum(w)
    weighted_ce: torch.Tensor  # scalar: sum(w * CE)
    weight_sum: torch.Tensor  # scalar
    correct: torch.Tensor  # bool [B, A, bs-1]: draft argmax == label (False where there is no label)
    full_blocks: torch.Tensor  # bool [B, A]: anchors with a label at every offset 1..bs-1


def block_loss(model: DFlashDraftModel, hidden: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor,
               weights: torch.Tensor, chunk: int = 2048) -> BlockLoss:
    """hidden [B, A, bs, H] from `block_hidden`; labels/weights [B, A, bs] from `block_labels`."""
    if model.spec.final_logit_softcapping:
        raise NotImplementedError("training with final_logit_softcapping is not supported")
    rows = weights > 0
    normed = model.norm(hidden[rows])
    weighted_ce, hit = LinearCrossEntropy.apply(normed, lm_head.weight, lm_head.bias, labels[rows], weights[rows],
                                                float(model.spec.output_multiplier), chunk)
    correct = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    correct[rows] = hit
    weight_sum = weights.sum()
    full_blocks = (labels[..., 1:] != IGNORE).all(-1)
    return BlockLoss(weighted_ce / weight_sum.clamp(min=1e-6), weighted_ce, weight_sum, correct[..., 1:], full_blocks)

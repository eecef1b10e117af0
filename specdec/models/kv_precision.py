"""How much an FP8 (e4m3) KV cache changes each layer's attention, measured against the model's own
attention on a text.

    errors = fp8_layer_errors(model, token_ids)     # one LayerError per decoder layer

The model runs once as a plain causal LM over `token_ids` (fp32 on CPU is the reference), keeping
each layer's queries, keys and values (after RoPE). Each layer's attention output is then recomputed
with K and V rounded through e4m3 (scale 1.0, as the cache stores them by default; and with a scale
from the layer's own max |K|, |V|), with only K or only V rounded, with K and V rounded to bf16, and
with the keys smoothed (per RoPE-pair factors divided out of K and multiplied into Q, the folding
proposed for FP8 caches); the error is |out' - out| / |out| over the whole sequence. A layer whose
FP8 error is far above the others' is one whose cache should stay in the model dtype:

    layers = full_precision_layers(fp8_errors(model, calibration_ids(model, tokenizer, device)))
    errors = calibrated_fp8_errors(model, tokenizer, model_dir, cache_dir, device)   # the same, cached

(measured on the default target: layers 0, 1 and 15 lose 16-51% of their attention output to e4m3 keys,
the others 2-9%; scales and smoothing do not help, keeping layers 0 and 1 in full precision restores
greedy outputs: BENCHMARKS.md, "FP8 KV error per layer").
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from attention.kv_cache import CALIBRATION_HEADROOM, FP8_DTYPE, FP8_MAX
from specdec.models.decoder import CausalLM

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")  # prose, code and arithmetic, ~400 tokens
CALIBRATION_TOKENS = 512

# a layer keeps the model dtype when its FP8 error is over twice the median layer's and over 12%
OUTLIER_FACTOR, OUTLIER_FLOOR = 2.0, 0.12


@dataclass(frozen=True)
class LayerError:
    layer: int
    max_k: float  # max |K| over the text (after RoPE)
    max_v: float
    fp8: float  # K and V in e4m3, scale 1.0
    fp8_calibrated: float  # K and V in e4m3, scales max |x| * headroom / 448
    fp8_k_only: float
    fp8_v_only: float
    fp8_smoothed_keys: float  # K divided by per-pair factors (and Q multiplied by them), then e4m3
    bf16: float


def capture_attention(model: CausalLM, token_ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (q, k, v) [tokens, heads, head_dim] of one causal forward over `token_ids`."""
    captured = []

    def layer_attention(i, rope):
        def attend(projections, h):
            q, k, v = projections.project(h, rope)
            captured.append((q.float().clone(), k.float().clone(), v.float().clone()))
            return causal_attention(q, k, v).to(q.dtype)

        return attend

    with torch.no_grad():
        positions = torch.arange(len(token_ids), device=token_ids.device)
        model.hidden_states(token_ids, positions, layer_attention)
    return captured


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence, causal, grouped-query: [tokens, heads, head_dim] in, the same shape out."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def round_fp8(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x as the cache would store and return it: divided by scale, saturated, e4m3, times scale."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale


def pair_smoothing(k: torch.Tensor) -> torch.Tensor:
    """Per kv head and channel factors >= 1 that bring each RoPE pair's max norm down to the head's
    median (the two channels of a pair share one: RoPE rotates them together). [kv_heads, head_dim]"""
    half = k.shape[-1] // 2
    pair = (k[..., :half] ** 2 + k[..., half:] ** 2).sqrt().amax(dim=0)
    factors = (pair / pair.median(dim=-1, keepdim=True).values).clamp(min=1.0)
    return torch.cat([factors, factors], dim=-1)


def fp8_layer_errors(model: CausalLM, token_ids: torch.Tensor) -> list[LayerError]:
    errors = []
    for i, (q, k, v) in enumerate(capture_attention(model, token_ids)):
        reference = causal_attention(q, k, v)
        max_k, max_v = k.abs().max().item(), v.abs().max().item()
        k_scale, v_scale = (max(m * CALIBRATION_HEADROOM / FP8_MAX, 1e-6) for m in (max_k, max_v))
        smooth = pair_smoothing(k)
        q_smooth = q * smooth.repeat_interleave(q.shape[1] // k.shape[1], dim=0)
        errors.append(LayerError(
            i, max_k, max_v, relative_error(reference, q, round_fp8(k), round_fp8(v)),
            relative_error(reference, q, round_fp8(k, k_scale), round_fp8(v, v_scale)),
            relative_error(reference, q, round_fp8(k), v), relative_error(reference, q, k, round_fp8(v)),
            relative_error(reference, q_smooth, round_fp8(k / smooth), round_fp8(v)),
            relative_error(reference, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float())))
    return errors


def fp8_errors(model: CausalLM, token_ids: torch.Tensor) -> list[float]:
    """Each layer's attention error with K and V in e4m3 at scale 1.0 (the cache's default)."""
    return [relative_error(causal_attention(q, k, v), q, round_fp8(k), round_fp8(v))
            for q, k, v in capture_attention(model, token_ids)]


def full_precision_layers(errors: list[float]) -> tuple[int, ...]:
    """The layers whose FP8 error stands out (over OUTLIER_FACTOR x the median and OUTLIER_FLOOR)."""
    limit = max(OUTLIER_FACTOR * statistics.median(errors), OUTLIER_FLOOR)
    return tuple(i for i, error in enumerate(errors) if error > limit)


def calibration_ids(model: CausalLM, tokenizer, device: torch.device) -> torch.Tensor:
    """The shipped calibration text through the model's tokenizer, within the model's context; fixed
    spread-out ids where there is no tokenizer (or it makes too few ids of the model's vocabulary)."""
    config = model.config
    length = min(CALIBRATION_TOKENS, config.max_position_embeddings)
    ids = tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:length] if tokenizer is not None else []
    if len(ids) < length // 2 or max(ids) >= config.vocab_size:
        ids = ((torch.arange(length) * 7919) % (config.vocab_size - 3) + 3).tolist()
    return torch.tensor(ids, dtype=torch.long, device=device)


def calibrated_fp8_errors(model: CausalLM, tokenizer, model_dir: Path | None, cache_dir: Path | None,
                          device: torch.device) -> list[float]:
    """`fp8_errors` on the calibration text, read from `cache_dir` when it was computed there for the same
    model directory, weights, text, dtype and device type, else computed (and kept there if it can be)."""
    key = _calibration_key(model, model_dir, device)
    cache = None
    if cache_dir is not None and model_dir is not None:
        name = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
        cache = Path(cache_dir) / f"kv-fp8-errors-{name}.json"
    if cache is not None and cache.is_file():
        try:
            stored = json.loads(cache.read_text())
            if stored.get("key") == key:
                return stored["errors"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable: computed again below
    errors = fp8_errors(model, calibration_ids(model, tokenizer, device))
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"model_dir": str(model_dir), "key": key, "errors": errors}))
        except OSError:
            pass  # a read-only cache: computed again next time
    return errors


def _calibration_key(model: CausalLM, model_dir: Path | None, device: torch.device) -> str:
    """What the errors depend on: the weight files (names, sizes, times), the text, the dtype, the device."""
    digest = hashlib.sha256(CALIBRATION_TEXT.read_bytes())
    digest.update(f"{model.model.embed_tokens.weight.dtype} {device.type} {CALIBRATION_TOKENS}".encode())
    if model_dir is not None:
        for path in sorted(Path(model_dir).glob("*")):
            if path.suffix in (".safetensors", ".bin", ".json"):
                stat = path.stat()
                digest.update(f"{path.name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def relative_error(reference: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    return ((causal_attention(q, k, v) - reference).norm() / reference.norm()).item()

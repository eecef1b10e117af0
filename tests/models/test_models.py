"""Our decoder equals transformers' on tiny random Llama / Qwen2 / Qwen3 models."""

import pytest
import torch

from attention.batch_layout import BatchLayout
from attention.kv_cache import KVCache
from attention.page_pool import PagePool, PageTable
from attention.torch_backend import TorchBackend
from specdec.models.loader import load_causal_lm, read_config


def run_prefill(model, prompts, page_size=4, feature_layers=()):
    cfg = model.config
    pool = PagePool(64, page_size)
    kv = KVCache(cfg.num_hidden_layers, 64, page_size, cfg.num_key_value_heads, model.head_dim, torch.float32, "cpu")
    attn = TorchBackend(cfg.num_attention_heads, cfg.num_key_value_heads, model.head_dim, model.head_dim ** -0.5)
    tables = []
    for p in prompts:
        t = PageTable(pool)
        t.grow(len(p))
        tables.append(t)
    attn.plan(BatchLayout.for_tokens([len(p) for p in prompts], [len(p) for p in prompts],
                                     [t.pages for t in tables], page_size, causal=True))
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([j for p in prompts for j in range(len(p))])
    out = model(ids, pos, kv, attn, logits_rows=torch.arange(len(ids)), feature_layers=feature_layers)
    return out


def test_logits_and_features_match_transformers(tiny_model_dir):
    path, hf = tiny_model_dir
    model = load_causal_lm(path, torch.device("cpu"), torch.float32)
    prompts = [[5, 17, 33, 2, 9, 11, 40], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]
    layers = (0, 2)
    out = run_prefill(model, prompts, feature_layers=layers)
    start = 0
    for p in prompts:
        ref = hf(torch.tensor([p]), output_hidden_states=True)
        ours = out.logits[start:start + len(p)]
        torch.testing.assert_close(ours, ref.logits[0].float(), atol=1e-4, rtol=1e-4)
        feats = out.features[start:start + len(p)]
        expected = torch.cat([ref.hidden_states[i + 1][0] for i in layers], dim=-1)
        torch.testing.assert_close(feats, expected, atol=1e-4, rtol=1e-4)
        start += len(p)


def test_unsupported_architecture_is_named(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama, qwen2, qwen3"):
        read_config(tmp_path)

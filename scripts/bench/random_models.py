"""Random-weight models of a real model's shape, built locally (no hub, no download), for timing runs
where the weights' values do not matter: a target with a word-level tokenizer, and a tiny drafter."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

from drafters.training.drafter_config import DrafterShape, save_random_drafter

# qwen2.5-coder-1.5b-instruct as specdec's GGUF conversion writes it (untied: the GGUF has its own output.weight)
TARGET_SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
TINY_SHAPE = dict(TARGET_SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=1024, bos_token_id=510, eos_token_id=511)


def save_tokenizer(path: Path, config) -> None:
    """A word-level tokenizer over the whole vocabulary (token i is "t{i}"): the loader needs a tokenizer,
    and every id decodes."""
    names = {config.bos_token_id: "<|endoftext|>", config.eos_token_id: "<|im_end|>"}
    vocab = {names.get(i, f"t{i}"): i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                            pad_token="<|endoftext|>").save_pretrained(path)


def random_target(path: Path, shape: dict, device: torch.device, std: float = 0.02, seed: int = 0) -> Path:
    """Save a random-weight Qwen2 model (bf16) and a tokenizer to `path`. Built on the meta device and
    filled on `device`: initializing ~1.8B parameters on the host takes longer than a benchmark."""
    torch.manual_seed(seed)
    config = Qwen2Config(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:  # q/k/v biases
                p.zero_()
            else:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    save_tokenizer(path, config)
    return path


def tiny_drafter(path: Path, target_dir: Path) -> Path:
    """A one-layer, block-4 random DFlash drafter that fits the target in `target_dir`."""
    config = AutoConfig.from_pretrained(target_dir)
    shape = DrafterShape(num_layers=1, heads=4, kv_heads=2, head_dim=16, intermediate_size=64, block_size=4)
    save_random_drafter(path, config, shape, mask_token_id=config.vocab_size - 3)
    return path

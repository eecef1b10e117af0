"""Tokenizers built in the test session (no downloads), and the chat template the tiny models use."""

from __future__ import annotations

import json
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

# ChatML, as Qwen's templates write it
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# ChatML with tools, as Qwen2.5's template writes them: the tools in a system turn, an assistant's calls as
# <tool_call> blocks, tool results as "tool" turns
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Hello world, this is a tiny corpus for a tiny tokenizer.", "The quick brown fox jumps over the lazy dog.",
          "Streaming text arrives token by token; stop strings must be found.", "naïve café résumé, Zürich straße"] * 20
LONG_TOKEN = "\n" + " " * 80  # SmolLM2 has this 81-character string as a single token


def bytelevel_tokenizer() -> Tokenizer:
    """GPT-2 / Qwen / SmolLM2 style: byte-level BPE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_tokens([LONG_TOKEN])  # a long token, as in SmolLM2
    return tok


def gguf_style(tok: Tokenizer, pre_tokenizer: dict | None = None) -> Tokenizer:
    """`tok` (byte-level) as transformers' GGUF conversion writes it: its ByteLevel decoder wrapped in
    sentencepiece-style steps and byte fallback on (it decodes the same; `pre_tokenizer` replaces its own)."""
    spec = json.loads(tok.to_str())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    spec["model"]["byte_fallback"] = True
    if pre_tokenizer is not None:
        spec["pre_tokenizer"] = pre_tokenizer
    return Tokenizer.from_str(json.dumps(spec))


def as_transformers(tok: Tokenizer, **kwargs) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def save_char_tokenizer(path):
    """A byte-level tokenizer of single characters (85 ids, inside the tiny model's 96), ChatML template.

    Byte-level, because transformers loads a qwen2 model directory's tokenizer as Qwen2Tokenizer,
    which always pre-tokenizes byte-level."""
    byte_char = bytes_to_unicode()
    # ids 0..2 agree with the tiny model's pad / bos / eos ids
    tokens = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
    tokens += [byte_char[ord(c)] for c in string.ascii_letters + string.digits + " \n\\{}$^_()+-=*/.,?"]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

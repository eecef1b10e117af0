"""GGUF file -> Hugging Face model directory (config, bf16 safetensors, tokenizer, generation config).

transformers reads GGUF through the `gguf` package but marks the model as quantized and refuses
`save_pretrained`; the conversion rebuilds a plain model from the config, loads the de-quantized
state dict and saves that. Special-token ids come from the GGUF metadata.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib

logger = logging.getLogger(__name__)

def gguf_token_metadata(gguf_path: pathlib.Path) -> dict:
    """Special token ids, and the text of the padding token, from GGUF metadata."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    meta: dict = {}

    def scalar(key: str):
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        try:
            return value.tolist()[0]
        except Exception:
            return None

    for short in ("bos", "eos", "eot", "eom", "padding", "unknown"):
        value = scalar(f"tokenizer.ggml.{short}_token_id")
        if value is not None:
            meta[f"{short}_token_id"] = int(value)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    pad = meta.get("padding_token_id")
    if tokens is not None and pad is not None and 0 <= pad < len(tokens.data):
        meta["padding_token"] = bytes(tokens.parts[tokens.data[pad]]).decode("utf-8", "replace")
    arch = reader.fields.get("general.architecture")
    if arch is not None:
        meta["architecture"] = bytes(arch.parts[arch.data[0]]).decode("utf-8", "replace")
    return meta


def eos_token_ids_from_metadata(meta: dict) -> list[int]:
    """Stop tokens implied by the GGUF metadata.

    The declared EOS first, then end-of-turn / end-of-message tokens if the
    file declares them, then the padding token when it is ``<|endoftext|>``
    (the document end of the Qwen and SmolLM vocabularies, which chat models
    may also emit).  For Qwen2.5 instruct this gives ``[151645, 151643]``
    (``<|im_end|>``, ``<|endoftext|>``) and for SmolLM2 ``[2]``.
    """
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(key)
        if value is not None and value not in ids:
            ids.append(value)
    pad = meta.get("padding_token_id")
    if pad is not None and pad not in ids and meta.get("padding_token") == "<|endoftext|>":
        ids.append(pad)
    return ids


@contextlib.contextmanager
def one_parse_per_file():
    """Within it, `gguf.GGUFReader` parses each file once and hands the same reader to every later call. A
    conversion reads a GGUF four times (its token metadata here; transformers' config, weights and tokenizer), and a
    parse of the default target's file (its 151,936 tokens and merges as metadata arrays) takes ~6 s of Python on a
    2-core machine; the readers are read-only views of the file, so one serves them all. transformers imports
    `GGUFReader` from gguf at each call, so it gets this one; the test of one parse per conversion notices if not."""
    import gguf

    parse = gguf.GGUFReader
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _no_init_context():
    try:
        from transformers.initialization import no_init_weights

        return no_init_weights()
    except Exception:  # pragma: no cover - other transformers layouts
        return contextlib.nullcontext()


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype=None,
) -> dict:
    """Convert a GGUF file into a Hugging Face model directory ``out_dir``.

    Weights are dequantized by transformers' GGUF loader, rebuilt into a plain
    (non-quantized) model and saved as safetensors in ``dtype`` (bfloat16 by
    default), together with the tokenizer (chat template included) and a
    generation config whose ``eos_token_id`` lists the stop tokens the GGUF
    metadata implies.  Writes directly into ``out_dir``; callers wanting
    atomicity write into a temporary directory and rename it.  Returns a
    summary dict.
    """
    with one_parse_per_file():
        return _convert(pathlib.Path(gguf_path), pathlib.Path(out_dir), dtype)


def _convert(gguf_path: pathlib.Path, out_dir: pathlib.Path, dtype) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype is None:
        dtype = torch.bfloat16
    out_dir.mkdir(parents=True, exist_ok=True)
    # An absolute gguf_file: transformers looks it up relative to the working
    # directory first, so a bare file name could pick up an unrelated file.
    directory, file_name = str(gguf_path.parent.resolve()), str(gguf_path.resolve())

    meta = gguf_token_metadata(gguf_path)
    eos_ids = eos_token_ids_from_metadata(meta)

    load_kwargs: dict = {"gguf_file": file_name, "dtype": dtype, "low_cpu_mem_usage": True}
    try:  # ask for plain dense weights even where packed GGUF kernels exist
        from transformers import GgufConfig

        load_kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except Exception:  # pragma: no cover - older transformers
        pass
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(directory, **load_kwargs)
    except TypeError:  # pragma: no cover - older transformers without these kwargs
        load_kwargs.pop("quantization_config", None)
        load_kwargs.pop("low_cpu_mem_usage", None)
        load_kwargs["torch_dtype"] = load_kwargs.pop("dtype")
        gguf_model = AutoModelForCausalLM.from_pretrained(directory, **load_kwargs)

    # transformers marks GGUF-loaded models as quantized and will not save
    # them: rebuild a plain model from a config without quantization_config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    gen_source = getattr(gguf_model, "generation_config", None)
    state = gguf_model.state_dict()
    with _no_init_context():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # the loaded tensors are adopted, not copied: they already have the dtype asked for
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    del state, gguf_model
    # The only keys allowed to be missing are ones tied to a loaded weight.
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        tied = {k for k in missing if k.endswith("lm_head.weight")}
    bad_missing = [k for k in missing if k not in tied]
    if bad_missing or unexpected:
        raise RuntimeError(
            f"Converting {gguf_path.name}: state dict does not match the rebuilt model "
            f"(missing: {bad_missing[:5]}, unexpected: {list(unexpected)[:5]})"
        )
    model = model.to(dtype)
    model.eval()

    # Generation config: ids from the GGUF, no sampling defaults invented.
    gen = GenerationConfig()
    if gen_source is not None:
        for key in ("bos_token_id", "pad_token_id", "eos_token_id"):
            value = getattr(gen_source, key, None)
            if value is not None:
                setattr(gen, key, value)
    if "bos_token_id" in meta:
        gen.bos_token_id = meta["bos_token_id"]
    if "padding_token_id" in meta:
        gen.pad_token_id = meta["padding_token_id"]
    if eos_ids:
        gen.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    model.generation_config = gen

    model.save_pretrained(str(out_dir), safe_serialization=True)
    del model

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file_name)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template", gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    # The saved tokenizer config must not point back at the GGUF file.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        with open(tok_cfg_path, encoding="utf-8") as f:
            tok_cfg = json.load(f)
        if tok_cfg.pop("gguf_file", None) is not None:
            with open(tok_cfg_path, "w", encoding="utf-8") as f:
                json.dump(tok_cfg, f, indent=2, ensure_ascii=False)

    return {
        "architecture": meta.get("architecture"),
        "model_type": getattr(config, "model_type", None),
        "eos_token_id": eos_ids,
        "bos_token_id": meta.get("bos_token_id"),
        "pad_token_id": meta.get("padding_token_id"),
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "dtype": str(dtype).replace("torch.", ""),
    }

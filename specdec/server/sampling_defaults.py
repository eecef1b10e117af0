"""Defaults for the sampling settings a request leaves out, from the model's generation_config.json, as vLLM's and
SGLang's servers take them: a model whose authors recommend, say, temperature 0.7 and top_k 20 answers with those
unless the request says otherwise. Without such a file (the demo models' GGUF conversions have none) a request
gets OpenAI's defaults.

    defaults = sampling_defaults("auto", model_dir)   # or "none", or a folder holding a generation_config.json
    body.sampling_params(max_new_tokens, defaults)
"""

from __future__ import annotations

from pathlib import Path

from specdec.engine.sampling_params import SamplingParams
from specdec.models.loader import read_json_object

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(source: str, model_dir: str | Path | None) -> dict:
    """The sampling settings `source` gives: "auto" the model directory's generation_config.json (if it has one),
    "none" nothing, anything else a folder whose generation_config.json must exist. Raises ValueError naming the
    file when it is unreadable or its values are no valid settings."""
    if source == "none":
        return {}
    folder = Path(model_dir) if source == "auto" and model_dir is not None else Path(source)
    file = folder / "generation_config.json"
    if not file.is_file():
        if source == "auto":
            return {}
        raise ValueError(f"--generation-config {source}: no generation_config.json there; give a folder that holds "
                         f"one, auto (the model's own) or none")
    raw = read_json_object(file, "the model's generation config")
    defaults = {name: raw[name] for name in FIELDS if raw.get(name) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from err
    return defaults

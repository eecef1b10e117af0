"""specdec: speculative decoding with DFlash block drafting.

The library API is `LLM`, `SamplingParams` (with `StructuredOutput`) and `GenerationResult`. They are imported on first use, so
that importing a lower layer (`specdec.models`, `specdec.engine`, ...) does not load the whole engine.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"LLM": "specdec.llm", "GenerationResult": "specdec.llm", "SamplingParams": "specdec.engine.sampling_params",
            "StructuredOutput": "specdec.engine.structured_output"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

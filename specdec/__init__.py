"""specdec: speculative decoding with DFlash block drafting."""

from specdec.llm import LLM, GenerationResult
from specdec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "GenerationResult"]

"""Engine configuration: one frozen dataclass, validated on creation; the CLI maps onto it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _valid_device(device) -> bool:
    if not isinstance(device, str):
        return False
    kind, _, index = device.partition(":")
    return device in ("auto", "cpu") or (kind == "cuda" and (not index or index.isdigit()))


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"  # auto = the model dtype; fp8 = float8 e4m3 with per-layer scales
    page_size: int = 16
    num_kv_pages: int | None = None  # None = sized from memory (see kv_cache_memory_fraction / cpu_kv_cache_gib)
    gpu_memory_utilization: float = 0.9  # fraction of total GPU memory the engine may use in all
    cpu_kv_cache_gib: float = 2.0  # KV pool size on CPU when num_kv_pages is None
    max_num_seqs: int = 64  # requests decoded together
    max_prefill_tokens: int = 4096  # prefill tokens per step; a longer prompt is prefilled in chunks
    attention_backend: str = "auto"  # auto | torch | flashinfer
    # FP8 KV scales: 1.0 per layer by default (K/V of Llama/Qwen-sized models sit well inside e4m3's
    # +-448); True derives per-layer scales from the first prefill's max |K|, |V| (with headroom)
    calibrate_fp8_scales: bool = False
    # the drafter's context cache: auto = the model dtype (it is small: a few layers, and needs no
    # quantization kernels); fp8 = float8 e4m3 like the target's
    drafter_kv_cache_dtype: str = "auto"
    # CUDA graphs for the decode, verify and draft steps (CUDA only; CPU is always eager)
    enforce_eager: bool = False

    def __post_init__(self):
        problems = []
        if not _valid_device(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype != "auto" and DTYPE_ALIASES.get(self.dtype, self.dtype) not in DTYPES:
            problems.append(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.drafter_kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"drafter_kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                            f"{self.drafter_kv_cache_dtype!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            problems.append(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            problems.append(f"num_kv_pages must be positive, got {self.num_kv_pages}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_prefill_tokens < 1:
            problems.append("max_num_seqs and max_prefill_tokens must be positive")
        if problems:
            raise ValueError("invalid engine configuration: " + "; ".join(problems))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was requested but CUDA is not available; use --device cpu")
        return device

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[DTYPE_ALIASES.get(self.dtype, self.dtype)]

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype.startswith("fp8")

"""The systems that `scripts/bench_peers.py` compares, behind one small interface.

A system is built once, then `generate(prompt_ids, max_new_tokens)` runs one prompt at batch 1,
greedy, and returns a `Sample`; `info()` describes it for the JSON and `close()` drops it.

Timing (wall clock; on CUDA the device is synchronized at every measurement point):
- ours-*: the engine's per-request stats (`specdec.engine.metrics.RequestStats`): first token = the
  prefill's token committed; TPOT = (last commit - first token) / (generated - 1).
- hf-generate, hf-assisted: a streamer stamps the first emission of generated tokens (after the
  target's prefill; for assisted generation after the first draft + verify round, which can emit
  several tokens at once) and generation ends when `generate` returns; TPOT = (end - first
  emission) / (tokens emitted after the first emission). For hf-generate that is (generated - 1).
- zlab-dflash: a forward hook on the target stamps the end of its first forward (the prefill);
  TPOT = (end - prefill end) / (generated - 1). `return_stats` of the dflash package is not used (it
  synchronizes CUDA unconditionally and divides by generated rather than generated - 1).

tau (tokens committed per target verify forward, bonus included):
- ours-dflash-*: from the engine's stats (mean of the request's acceptance lengths);
- zlab-dflash: (generated - 1) / (target forwards - 1): every target forward after the prefill is
  one verify step, and the prefill's token is not committed by one; the same quantity as ours;
- hf-assisted: generated / target forwards (its first target forward verifies the first drafts
  together with the prompt, so there is no separate prefill forward to leave out).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DFLASH_INSTALL_HINT = "pip install --no-deps dflash==0.1.0"


@dataclass
class Sample:
    token_ids: list[int]  # generated tokens only; a stop token that ended generation is included
    prompt_tokens: int
    wall_s: float  # the whole call, prefill included
    ttft_s: float | None
    tpot_s: float | None
    tau: float | None = None
    target_forwards: int | None = None

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)

    def as_dict(self) -> dict:
        return {**asdict(self), "generated_tokens": self.generated_tokens}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    synchronize(device)
    return time.perf_counter()


# ---- ours ----------------------------------------------------------------------------------------
class OursSystem:
    """`specdec.LLM` with or without a drafter; `max_num_seqs` 1 for the batch-1 table."""

    def __init__(self, target: str, drafter, *, device: str, kv_cache_dtype: str = "auto", max_num_seqs: int = 1,
                 num_kv_pages: int | None = None, overlap_steps: bool = True, verify: str = "chain"):
        from specdec import LLM

        self.llm = LLM(target, drafter, device=device, kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
                       num_kv_pages=num_kv_pages, overlap_steps=overlap_steps, verify=verify)
        self.device = self.llm.engine.device
        self.speculative = drafter is not None

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        from specdec import SamplingParams

        start = now(self.device)
        result = self.llm.generate([prompt_ids], SamplingParams(max_new_tokens=max_new_tokens))[0]
        wall = now(self.device) - start
        if result.finish_reason == "error":
            raise RuntimeError(f"the engine refused a prompt: {result.error}")
        stats = result.stats
        forwards = 1 + stats.verify_steps if self.speculative else stats.generated_tokens
        return Sample(list(result.token_ids), len(prompt_ids), wall, stats.ttft, stats.tpot,
                      stats.tau if self.speculative else None, forwards)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int):
        """All prompts submitted at once (up to max_num_seqs in flight): (results, summary, wall seconds)."""
        from specdec import SamplingParams

        start = now(self.device)
        results = self.llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
        wall = now(self.device) - start
        errors = [r.error for r in results if r.finish_reason == "error"]
        if errors:
            raise RuntimeError(f"the engine refused {len(errors)} prompt(s): {errors[0]}")
        return results, self.llm.last_summary, wall

    def info(self) -> dict:
        engine = self.llm.engine
        return {"attention_backend": engine.backend_name, "dtype": str(engine.dtype), "kv_dtype": str(engine.kv_dtype),
                "num_kv_pages": engine.num_pages, "page_size": engine.pool.page_size,
                "max_num_seqs": engine.config.max_num_seqs,
                "block_size": engine.drafter.block_size if engine.drafter is not None else None}

    def close(self) -> None:
        del self.llm


# ---- HF transformers -----------------------------------------------------------------------------
def load_hf_model(model_dir, device: torch.device, dtype: torch.dtype, eos_ids: list[int], pad_id: int):
    """An HF causal LM (sdpa attention) whose generation defaults are plain greedy: the checkpoint's own
    sampling settings (temperature, repetition penalty, ...) are dropped so every system decodes alike."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa",
                                                 device_map={"": device})
    model = model.eval().requires_grad_(False)
    model.generation_config = GenerationConfig(bos_token_id=getattr(model.config, "bos_token_id", None),
                                               eos_token_id=list(eos_ids), pad_token_id=pad_id)
    return model


class ForwardCounter:
    """Counts a module's forward calls and stamps the end of the first one (synchronized)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.module, self.device = module, device
        self.calls = 0
        self.first_end: float | None = None
        self.handles = []

    def __enter__(self):
        def pre(_module, _args):
            self.calls += 1

        def post(_module, _args, _output):
            if self.first_end is None:
                self.first_end = now(self.device)

        self.handles = [self.module.register_forward_pre_hook(pre), self.module.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def _emission_timer(device: torch.device):
    """A transformers streamer stamping the first emission of generated tokens (the first `put` is the prompt)."""
    from transformers.generation.streamers import BaseStreamer

    class EmissionTimer(BaseStreamer):
        def __init__(self):
            self.puts = 0
            self.first_time: float | None = None
            self.first_count = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 2:  # the tokens are already on the host: the device has produced them
                self.first_time = now(device)
                self.first_count = int(value.numel())

        def end(self):
            pass

    return EmissionTimer()


class HFSystem:
    """transformers `generate`, greedy; with `assistant_dir`, assisted generation with that draft model."""

    def __init__(self, model_dir, *, device: torch.device, dtype: torch.dtype, eos_ids: list[int], pad_id: int,
                 assistant_dir=None, target_model=None):
        self.device, self.eos_ids, self.pad_id = device, list(eos_ids), pad_id
        self.model = target_model if target_model is not None else load_hf_model(model_dir, device, dtype, eos_ids,
                                                                                  pad_id)
        self.assistant = None
        if assistant_dir is not None:
            self.assistant = load_hf_model(assistant_dir, device, dtype, eos_ids, pad_id)
            a_vocab, t_vocab = self.assistant.config.vocab_size, self.model.config.vocab_size
            if a_vocab != t_vocab:
                raise ValueError(f"the assistant {assistant_dir} has vocabulary size {a_vocab} but the target has "
                                 f"{t_vocab}; assisted generation here needs a shared tokenizer")
            defaults = self.assistant.generation_config._get_default_generation_params()
            gen = self.assistant.generation_config
            for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
                if getattr(gen, key, None) is None:
                    setattr(gen, key, defaults[key])

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        inputs = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        timer = _emission_timer(self.device)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        with ForwardCounter(self.model, self.device) as counter:
            start = now(self.device)
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                      max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
                                      pad_token_id=self.pad_id, streamer=timer, **extra)
            end = now(self.device)
        tokens = out[0, len(prompt_ids):].tolist()
        ttft = tpot = None
        if timer.first_time is not None:
            ttft = timer.first_time - start
            after = len(tokens) - timer.first_count
            tpot = (end - timer.first_time) / after if after > 0 else None
        tau = len(tokens) / counter.calls if self.assistant is not None and counter.calls else None
        return Sample(tokens, len(prompt_ids), end - start, ttft, tpot, tau, counter.calls)

    def info(self) -> dict:
        info = {"dtype": str(self.model.dtype), "attn_implementation": self.model.config._attn_implementation}
        if self.assistant is not None:
            gen = self.assistant.generation_config
            info.update(num_assistant_tokens=gen.num_assistant_tokens,
                        num_assistant_tokens_schedule=gen.num_assistant_tokens_schedule,
                        assistant_confidence_threshold=gen.assistant_confidence_threshold)
        return info

    def close(self) -> None:
        del self.model, self.assistant


# ---- z-lab's reference loop ----------------------------------------------------------------------
def dflash_import_error() -> str | None:
    """None when z-lab's `dflash` package is importable, else why not."""
    import importlib

    try:
        importlib.import_module("dflash.model")
    except Exception as err:  # ImportError, or a transformers it cannot work with
        return f"z-lab's dflash package is not importable ({type(err).__name__}: {err}); {DFLASH_INSTALL_HINT}"
    return None


def convert_drafter_for_zlab(drafter_dir, out_dir, device: torch.device, dtype: torch.dtype) -> None:
    """Rewrite a drafter checkpoint in plain `dtype` weights (`scripts/export_drafter.py`): z-lab's loader,
    vLLM and SGLang cannot read the compact fp8 storage of the shipped drafters (our loader dequantizes it)."""
    from scripts.export_drafter import export

    export(str(drafter_dir), str(out_dir), "bf16", device, dtype)


class ZLabSystem:
    """`dflash.model.DFlashDraftModel.spec_generate` with an HF target (sdpa) and our drafter, converted."""

    def __init__(self, model_dir, drafter_dir, *, device: torch.device, dtype: torch.dtype, eos_ids: list[int],
                 pad_id: int, target_model=None):
        from dflash.model import DFlashDraftModel

        self.device, self.eos_ids = device, list(eos_ids)
        self.target = target_model if target_model is not None else load_hf_model(model_dir, device, dtype, eos_ids,
                                                                                  pad_id)
        with tempfile.TemporaryDirectory(prefix="zlab-drafter-") as tmp:
            convert_drafter_for_zlab(drafter_dir, tmp, device, dtype)
            draft = DFlashDraftModel.from_pretrained(tmp, dtype=dtype, attn_implementation="sdpa").to(device)
        self.draft = draft.eval().requires_grad_(False)
        if self.draft.mask_token_id is None:
            raise ValueError(f"{drafter_dir}: the drafter config has no mask_token_id")

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Sample:
        inputs = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        with ForwardCounter(self.target, self.device) as counter:
            start = now(self.device)
            out = self.draft.spec_generate(target=self.target, input_ids=inputs, max_new_tokens=max_new_tokens,
                                           stop_token_ids=self.eos_ids, temperature=0.0)
            end = now(self.device)
        tokens = out[0, len(prompt_ids):].tolist()
        n = len(tokens)
        ttft = counter.first_end - start if counter.first_end is not None else None
        tpot = (end - counter.first_end) / (n - 1) if n > 1 and counter.first_end is not None else None
        tau = (n - 1) / (counter.calls - 1) if counter.calls > 1 else None
        return Sample(tokens, len(prompt_ids), end - start, ttft, tpot, tau, counter.calls)

    def info(self) -> dict:
        import importlib.metadata

        try:
            version = importlib.metadata.version("dflash")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return {"dtype": str(self.target.dtype), "dflash": version, "block_size": int(self.draft.block_size),
                "mask_token_id": int(self.draft.mask_token_id),
                "target_layer_ids": [int(i) for i in self.draft.target_layer_ids]}

    def close(self) -> None:
        del self.target, self.draft


def drafter_directory(name_or_path) -> Path:
    from drafters import resolve_drafter_path

    return resolve_drafter_path(name_or_path)

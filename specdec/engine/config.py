"""Engine configuration: one frozen dataclass, validated on creation.

The command line maps onto it one to one: specdec/arguments.py gives every field a flag of the same
name, with the `help` (and `choices`) of the field's metadata, so a new field gets its flag by itself.
"""

from __future__ import annotations

from dataclasses import Field, dataclass, field, fields

import torch

from specdec.engine.sampling_params import is_int, is_real

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
VERIFY_POLICIES = ("chain", "auto", "tree")
VERIFY_AHEAD_BATCHES = ("auto", "on", "off")
MAX_TREE_NODES = 255  # a tree step writes tree_nodes + 1 K/V slots per request past its length


def _valid_device(device) -> bool:
    if not isinstance(device, str):
        return False
    kind, _, index = device.partition(":")
    return device in ("auto", "cpu") or (kind == "cuda" and (not index or index.isdigit()))


def full_precision_layer_list(value) -> tuple[int, ...] | str | None:
    """`kv_cache_full_precision_layers` parsed: "auto", () for none, the layer indices, or None if invalid."""
    if value == "auto":
        return "auto"
    if value == "none":
        return ()
    parts = str(value).split(",")
    if not all(p.strip().isdigit() for p in parts):
        return None
    return tuple(sorted({int(p) for p in parts}))


def _type_problem(setting: Field, value) -> str | None:
    """Why `value` is not of the field's declared type (int, float, bool, str, each maybe "| None"), or
    None. A bool is no number here, a float field takes any finite real, and nothing is converted."""
    kind = setting.type.replace(" | None", "")
    if value is None and setting.type.endswith("| None"):
        return None
    ok = {"int": is_int, "float": is_real,
          "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str)}[kind](value)
    if ok:
        return None
    wanted = {"int": "an integer", "float": "a finite number", "bool": "true or false", "str": "a string"}[kind]
    return f"{setting.name} must be {wanted}{' or None' if setting.type.endswith('| None') else ''}, got {value!r}"


def _setting(default, help_text: str, **flag):
    """A field whose metadata carries its flag's --help text and any argparse extras (choices)."""
    return field(default=default, metadata={"help": help_text, **flag})


@dataclass(frozen=True)
class EngineConfig:
    device: str = _setting("auto", "auto, cpu, cuda or cuda:N (auto = cuda when available, else cpu)")
    dtype: str = _setting("auto", "model dtype (auto = bfloat16 on CUDA, float32 on CPU)",
                          choices=("auto", *DTYPES))
    kv_cache_dtype: str = _setting("auto", "the target's KV cache: auto = the model dtype, fp8 = float8 e4m3",
                                   choices=KV_CACHE_DTYPES)
    page_size: int = _setting(16, "KV cache page size in tokens")
    num_kv_pages: int | None = _setting(None, "KV pool size in pages (None = sized from memory: "
                                              "gpu_memory_utilization on CUDA, cpu_kv_cache_gib on CPU)")
    gpu_memory_utilization: float = _setting(0.9, "fraction of GPU memory the engine may use in all (weights, KV "
                                                  "pool, graphs)")
    cpu_kv_cache_gib: float = _setting(2.0, "KV pool size in GiB on CPU when num_kv_pages is None")
    max_num_seqs: int = _setting(64, "requests decoded together (the most in flight at once)")
    max_prefill_tokens: int = _setting(4096, "prefill tokens per step; a longer prompt is prefilled in chunks")
    # a context below the model's: requests are held to it, and what is sized by it (the RoPE tables, the bound on a
    # request's pages) shrinks. Above the model's it is refused: positions past those it was trained on are not served
    max_model_len: int | None = _setting(None, "the longest prompt + output in tokens (None = the model's context, "
                                               "its max_position_embeddings; at most that)")
    attention_backend: str = _setting("auto", "attention kernels (auto = flashinfer on CUDA when installed, "
                                              "else torch)", choices=("auto", "torch", "flashinfer"))
    # FP8 KV: layers whose attention e4m3 rounds too coarsely keep the model dtype (measured on the default
    # target: its layers 0, 1 and 15 lose 16-51% of their attention output to e4m3 keys, the rest 2-9%)
    kv_cache_full_precision_layers: str = _setting(
        "auto", "with an fp8 KV cache, the layers kept in the model dtype: auto (those whose FP8 attention "
                "error on a calibration text stands out), none, or a comma-separated list such as 0,1")
    # FP8 KV scales: 1.0 per layer by default (K/V of Llama/Qwen-sized models sit well inside e4m3's
    # +-448); True derives per-layer scales from the first prefill's max |K|, |V| (with headroom)
    calibrate_fp8_scales: bool = _setting(False, "FP8 KV: per-layer scales from the first prefill (otherwise "
                                                 "scale 1.0)")
    # the drafter's context cache: auto = the model dtype (it is small: a few layers, and needs no
    # quantization kernels); fp8 = float8 e4m3 like the target's
    drafter_kv_cache_dtype: str = _setting("auto", "the drafter's context cache (auto = the model dtype)",
                                           choices=KV_CACHE_DTYPES)
    # CUDA graphs for the decode, verify and draft steps (CUDA only; CPU is always eager)
    enforce_eager: bool = _setting(False, "run every step eagerly (no CUDA graphs; CPU is always eager)")
    # plain decoding: queue step N + 1 before reading step N's tokens back (specdec/engine/flight.py); on
    # an H100 it gives 1.21x at batch 1 and 1.36-1.41x at 64 concurrent requests (BENCHMARKS.md)
    # speculative decoding: queue the next step's draft before reading this step's tokens back (the drafter's
    # attention planned for the whole block accepted, the real lengths read on the device; drafters/dflash.py),
    # and with verify auto, run the plain steps it picks where no draft pays overlapped as plain decoding does
    overlap_steps: bool = _setting(True, "plain decoding: the host prepares and queues the next step before "
                                          "waiting for this one's tokens; speculative decoding: the next step's "
                                          "draft is queued before this step's tokens are read")
    # with overlap_steps, a lone request's chain step also queues the next step's verify before this step's tokens are
    # read (planned for the latest start it may have, the real one written on the device: docs/gpu.md). Off: on real
    # requests at batch 1 drafting ahead already hides the host, so it only adds its metadata kernels (steps 2.8%
    # slower than verifying in order; BENCHMARKS.md, 2026-12-05)
    verify_ahead: bool = _setting(False, "speculative decoding of a lone request: the next step's verify is queued "
                                         "with its draft, before this step's tokens are read (needs overlap_steps)")
    # the same for a batch whose verify graph keeps each request's KV in one piece (rungs of 64 and up, 49+ requests:
    # FlashInfer's plan then depends on the query counts alone, so one made for the latest starts serves the real
    # ones, whose page metadata the graph writes). Steps after which requests ended take it without their rows;
    # requests that could join wait one step. On one H100 it gave 1.12-1.18x DFlash's throughput on math500 and
    # 1.04-1.13x on the coding requests at concurrency 64-256 (BENCHMARKS.md, 2026-12-06). auto = on CUDA (such
    # rungs); on = on the CPU too, every batch, its acceptance read back (no faster there: what the tests exercise)
    verify_ahead_batches: str = _setting("auto", "speculative decoding of batches whose verify graph keeps each "
                                                 "request's KV in one piece (49+ requests): the next step's verify is "
                                                 "queued with its draft, before this step's tokens are read (needs "
                                                 "overlap_steps; auto = on CUDA, on = the CPU too)",
                                         choices=VERIFY_AHEAD_BATCHES)
    # speculative steps (specdec/engine/verify_policy.py): chain = every draft of the block every step;
    # auto = per step the chain length (the block, a half, three eighths, a quarter, an eighth) with the most committed
    # tokens per second, from running acceptance and step times measured after graph capture (without CUDA graphs:
    # the whole chain); tree = a token tree of block_size - 1 nodes from each position's top drafts
    # (specdec/engine/tree_speculator.py). auto is the default: on an H200 it matched the chain at batch 1 and
    # concurrency 8 and gave 1.2x at 64 and 1.4x at 128 (BENCHMARKS.md, bench-peers-h200-run5)
    verify: str = _setting("auto", "speculative steps: chain = verify every draft; auto = per step a token "
                                    "tree or a chain of as many drafts as pay for themselves at the step's "
                                    "batch size (measured step times); tree = always a token tree",
                           choices=VERIFY_POLICIES)
    # a token tree's draft nodes per request at small batches; fewer as the batch grows, since a step
    # verifies at most max(max_num_seqs x block_size, tree_nodes + 1) tokens, and a lone request's tree on the GPU
    # has at most the 15 its attention gives a decode's bits (`TargetRunner.tree_q`)
    tree_nodes: int = _setting(63, "token trees (verify tree / auto): draft nodes per request at small batches "
                                   "(a lone request's: at most 15 on the GPU, for output equal to plain decoding's)")
    # auto's budget steps (specdec/runtime/row_budget.py): blocks whose forward runs each request's share of the
    # step's rows, chosen from its drafts' confidence. Off by default: on one H200 a budget step cost about what a
    # chain of its q does, so auto ran no faster with them (BENCHMARKS.md, 2026-12-05); exact either way
    budget_steps: bool = _setting(False, "verify auto: also weigh budget steps, whose rows go to each request's "
                                         "drafts most likely to be kept (by the drafter's confidence)")
    # DFlash drafting: how far back each draft position attends in the drafter's context. A drafter trained on
    # short sequences accepts less on long prompts, where its attention spans distances it never saw; a window keeps
    # it within them (SGLang's speculative-dflash-draft-window-size). None: the window the drafter declares (its
    # config's dflash_config.draft_window: 2048 for the shipped drafter, whose training sequences were cut there;
    # on an H200, ~6k-token prompts: tau 2.51 against 1.69 without); 0: the whole context. Outputs stay exact
    draft_window: int | None = _setting(None, "DFlash drafting: context positions each draft position attends back "
                                              "(default: the drafter's declared window; 0 = the whole context)")
    # DFlash drafting: a draft step may score its positions against only the drafter's most frequent tokens (the
    # ranking beside its weights, drafters/token_ranking.py): the target's output layer is most of what a draft step
    # reads. Off by default: with the shipped drafter's ranking (MATH training solutions and library source) 32,768
    # tokens took 2-3% of tau at batch 1 and gave it back in step time (BENCHMARKS.md). Outputs stay exact
    draft_vocab: int = _setting(0, "DFlash drafting: score only the drafter's N most frequent tokens (its "
                                   "token_ranking.npz; 0 = the whole vocabulary)")
    # full pages of committed tokens (the target's KV and the drafter's context) are kept and shared by later
    # requests that start with the same tokens (attention/prefix_cache.py)
    enable_prefix_caching: bool = _setting(True, "reuse the KV (and drafter context) of cached prompt prefixes "
                                                 "(--no-prefix-caching: prefill every prompt in full)",
                                           aliases=("--prefix-caching",))

    def __post_init__(self):
        typed = (_type_problem(setting, getattr(self, setting.name)) for setting in fields(self))
        problems = [problem for problem in typed if problem]
        if problems:  # the checks below assume the types
            raise ValueError("invalid engine configuration: " + "; ".join(problems))
        if not _valid_device(self.device):
            problems.append(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype != "auto" and DTYPE_ALIASES.get(self.dtype, self.dtype) not in DTYPES:
            problems.append(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.drafter_kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"drafter_kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                            f"{self.drafter_kv_cache_dtype!r}")
        if not 1 <= self.tree_nodes <= MAX_TREE_NODES:
            problems.append(f"tree_nodes must be between 1 and {MAX_TREE_NODES}, got {self.tree_nodes}")
        if self.draft_window is not None and self.draft_window < 0:
            problems.append(f"draft_window must be 0 (the whole context) or a positive number of positions, got "
                            f"{self.draft_window}")
        if self.draft_vocab < 0:
            problems.append(f"draft_vocab must be 0 (the whole vocabulary) or a positive number of tokens, got "
                            f"{self.draft_vocab}")
        if self.verify not in VERIFY_POLICIES:
            problems.append(f"verify must be one of {', '.join(VERIFY_POLICIES)}, got {self.verify!r}")
        if self.verify_ahead_batches not in VERIFY_AHEAD_BATCHES:
            problems.append(f"verify_ahead_batches must be one of {', '.join(VERIFY_AHEAD_BATCHES)}, got "
                            f"{self.verify_ahead_batches!r}")
        if full_precision_layer_list(self.kv_cache_full_precision_layers) is None:
            problems.append("kv_cache_full_precision_layers must be auto, none or comma-separated layer indices "
                            f"(e.g. 0,1), got {self.kv_cache_full_precision_layers!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            problems.append(f"page_size must be a positive integer, got {self.page_size!r}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            problems.append(f"num_kv_pages must be positive, got {self.num_kv_pages}")
        if self.cpu_kv_cache_gib <= 0:
            problems.append(f"cpu_kv_cache_gib must be positive, got {self.cpu_kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be at least 2 (a prompt token and an output token), got "
                            f"{self.max_model_len}")
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

"""The generation loop: admit, prefill, decode (autoregressive or speculative), finish.

    engine = Engine(target, EngineConfig(...), drafter=None)
    request = engine.add_request(ids, params)       # any time between steps
    while engine.has_unfinished_requests:
        out = engine.step()                          # out.committed, out.finished
    engine.abort(request.request_id)                 # any time between steps

or, for a closed batch, `engine.run(requests, on_commit=callback)` (a loop over `step`).

One step = one decode phase for the requests whose prefill is complete: plain decoding (one token
per request, specdec/engine/decoding.py) or speculative decoding (a drafted block verified per
request, specdec/engine/speculator.py), with the step's prompt chunks of admitted requests (within a
token budget) riding along in its forward; a step with nothing to decode prefills alone. The phase
returns the tokens each request commits; the engine commits them. The scheduler plans the step
(specdec/engine/scheduler.py). With `overlap_steps` (plain decoding) a step queues its forward and then
commits the previous step's tokens, so each token is committed one step later (specdec/engine/flight.py); so do a
DFlash engine's plain steps, which `verify="auto"` runs where no draft pays (under heavy load), its drafter's
context kept up by each of them (`SpeculativeDecoding.launch`), and its steps of prompt chunks alone (a burst's
first prefill: the host prepares the next step while the GPU prefills; a speculative step lands them first).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from attention import resolve_backend_name
from attention.kv_cache import FP8_DTYPE, KVCache, layer_dtypes
from attention.page_pool import PagePool, PageTable
from attention.prefix_cache import PrefixCache
from attention.transfer import upload
from specdec.engine.config import EngineConfig, full_precision_layer_list
from specdec.engine.decoding import DecodePhase, PlainDecoding
from specdec.engine.drafter import DraftContext
from specdec.engine.flight import Flight
from specdec.engine.grammar import Grammars
from specdec.engine.logprobs import LogprobRows, TokenLogprob, unpack, wants_logprobs
from specdec.engine.request import Request
from specdec.engine.request_limits import RequestLimits
from specdec.engine.sampler import make_generator, sample_rows
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.scheduler import Scheduler
from specdec.engine.speculator import SpeculativeDecoding
from specdec.engine.tree_speculator import CANDIDATES_PER_POSITION, TreeDecoding
from specdec.engine.verify_policy import PLAIN, TREE, StepCosts, VerifyPolicy, verify_budgets, verify_lengths
from specdec.models.kv_precision import calibrated_fp8_errors, full_precision_layers
from specdec.models.loader import LoadedTarget
from specdec.models.logprobs import packed_logprobs
from specdec.runtime.cuda_graphs import collector_paused, ladder_sizes
from specdec.runtime.model_runner import GraphMemory
from specdec.runtime.target_runner import BUDGET_STEP, TREE_GRAPH_MAX_BATCH, TREE_STEP, PrefillChunks, TargetRunner

log = logging.getLogger(__name__)

OnCommit = Callable[[Request, list[int]], None]


def _ignore(request: Request, tokens: list[int]) -> None:
    pass


@dataclass
class StepOutput:
    committed: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, its new tokens), in order
    finished: list[Request] = field(default_factory=list)  # retired in this step: their pages are back
    preempted: list[Request] = field(default_factory=list)  # gave their pages back; requeued to recompute
ACTIVATION_RESERVE_BYTES = 2 << 30  # GPU memory kept free for activations and workspaces
INTERRUPTED = "generation was interrupted before this request finished"  # an aborted request's error


class Engine:
    def __init__(self, target: LoadedTarget, config: EngineConfig, drafter=None):
        self.config = config
        self.model = target.model
        self.tokenizer = target.tokenizer
        self.eos_token_ids = target.eos_token_ids
        self.device = next(self.model.parameters()).device
        self.dtype = self.model.model.embed_tokens.weight.dtype
        self.backend_name = resolve_backend_name(config.attention_backend, self.device)
        self.kv_dtype = self._kv_dtype(config.fp8_kv)
        mc = self.model.config
        # with an FP8 cache, the layers it would hold too coarsely keep the model dtype
        self.full_precision_layers = self._full_precision_layers(target) if self.kv_dtype == FP8_DTYPE else ()
        layer_kv_dtypes = layer_dtypes(mc.num_hidden_layers, self.kv_dtype, self.full_precision_layers, self.dtype)
        self.drafter_kv_dtype = self._kv_dtype(config.drafter_kv_cache_dtype.startswith("fp8"))
        self.max_context = self._max_context(config.max_model_len, mc.max_position_embeddings)
        self.drafter = drafter
        block = drafter.block_size if drafter is not None else 1
        if config.verify == "tree" and drafter is not None and not drafter.proposes_candidates:
            raise ValueError(f"verify='tree' needs a drafter that proposes several candidates per position (DFlash); "
                             f"{type(drafter).__name__} proposes one: pass verify='chain' or 'auto'")
        # the verify lengths speculative steps choose from (tokens per request: the anchor and drafts), and
        # whether they may verify token trees
        # under load auto may also run plain decoding steps (no draft), overlapped as plain decoding's are
        plain_steps = config.overlap_steps and config.verify == "auto"
        chain_lengths = verify_lengths(block, config.verify, plain_steps) if drafter is not None else (1,)
        trees = drafter is not None and config.verify in ("tree", "auto") and drafter.proposes_candidates
        tree_nodes = config.tree_nodes if trees else 0
        # auto's budget steps: chains' rows shared out by the drafts' confidence
        budgets = verify_budgets(chain_lengths, config.budget_steps and config.verify == "auto" and drafter is not None
                                 and drafter.proposes_confidence)
        lookahead = max(block, tree_nodes + 1)  # slots a step may write past the committed length
        self.model.rotary.max_positions = self.max_context + lookahead  # RoPE table size on the fused path
        # the runners' static buffers exist before the KV pool is sized from what memory is left
        self.runner = TargetRunner(self.model, backend_name=self.backend_name, kv_dtype=layer_kv_dtypes,
                                   page_size=config.page_size, max_batch=config.max_num_seqs,
                                   block_lens=chain_lengths or (block,), max_prefill_tokens=config.max_prefill_tokens,
                                   max_context=self.max_context,
                                   feature_layers=drafter.target_layer_ids if drafter is not None else (),
                                   tree_nodes=tree_nodes, budgets=budgets,
                                   # with the draft ahead
                                   verify_ahead=config.overlap_steps and config.verify_ahead,
                                   verify_ahead_batches=config.overlap_steps and (
                                       config.verify_ahead_batches == "on"
                                       or (config.verify_ahead_batches == "auto" and self.device.type == "cuda")))
        if drafter is not None:
            drafter.attach(DraftContext(self.device, self.dtype, self.drafter_kv_dtype, config.page_size, self.backend_name,
                                        config.max_num_seqs, self.max_context, self.model.model.embed_tokens,
                                        self.model.lm_head, config.calibrate_fp8_scales, self.runner.features_out,
                                        CANDIDATES_PER_POSITION if trees else 0,
                                        # auto runs trees where they can pay: small batches
                                        TREE_GRAPH_MAX_BATCH if config.verify == "auto" else 0,
                                        tuple(q - 1 for q in chain_lengths),
                                        drafter.draft_window if config.draft_window is None else config.draft_window,
                                        config.draft_vocab, bool(budgets)))
        self.use_graphs = (self.device.type == "cuda" and not config.enforce_eager
                           and self.runner.attn.supports_graphs)
        # the graphs' memory pool is counted before the KV pool takes what is left
        self.graph_memory = self._graph_memory(drafter) if self.use_graphs else GraphMemory()
        self.num_pages = self._num_pages(drafter)
        self.pool = PagePool(self.num_pages, config.page_size)
        self.runner.allocate_kv(self.num_pages, config.calibrate_fp8_scales)
        if self.kv.is_fp8 and target.kv_scales is not None and not config.calibrate_fp8_scales:
            self.kv.set_scales(target.kv_scales.k, target.kv_scales.v)  # the checkpoint's own
        if drafter is not None:
            drafter.allocate_cache(self.num_pages)
            self.decoding: DecodePhase = SpeculativeDecoding(
                self.runner, drafter, VerifyPolicy(block, chain_lengths, tree=trees, budgets=budgets),
                TreeDecoding(self.runner, drafter, draft_ahead=config.overlap_steps) if trees else None,
                draft_ahead=config.overlap_steps)
        else:
            self.decoding = PlainDecoding(self.runner)
        # one entry per cached page: the target's KV page and, when the drafter keeps a context cache, its page
        context_pool = drafter.context_pool if drafter is not None else None
        self.prefix_cache = PrefixCache([self.pool] + ([context_pool] if context_pool is not None else [])) \
            if config.enable_prefix_caching else None
        # overlapped steps: plain decoding only (a speculative step's plans need the previous acceptance)
        self.overlap = config.overlap_steps and drafter is None
        self.flight: Flight | None = None  # the launched step whose tokens are not committed yet
        # a step reserves a tree's slots per request only at the running batch sizes that may verify trees: under
        # auto up to TREE_GRAPH_MAX_BATCH, every one with verify="tree". An empty or lone batch under auto verifies
        # no tree but holds a tree's slots too: the room must not grow with the batch (`Scheduler.room`)
        tree_batches = (range(0) if not trees else range(config.max_num_seqs + 1) if config.verify == "tree"
                        else range(TREE_GRAPH_MAX_BATCH + 1))
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_prefill_tokens, block,
                                   self.prefix_cache, (tree_nodes + 1 if trees else 0, tree_batches))
        self.limits = RequestLimits(self.max_context, mc.vocab_size, self.num_pages, config.page_size, lookahead)
        self._next_id = 0
        self._grammars: Grammars | ValueError | None = None  # `grammars`, or why this model has none
        self.graph_capture_seconds: float | None = None
        self.graph_memory_bytes = 0
        # calibrated FP8 scales are baked into the graphs: capture after the first prefill has set them
        if self.use_graphs and not (config.calibrate_fp8_scales and self.kv.is_fp8):
            self.capture_graphs()

    @staticmethod
    def _max_context(max_model_len: int | None, model_context: int) -> int:
        if max_model_len is None:
            return model_context
        if max_model_len > model_context:
            raise ValueError(f"max_model_len {max_model_len} is more than this model's context ({model_context} "
                             f"tokens, its max_position_embeddings): give at most {model_context}, or leave it unset")
        return max_model_len

    @property
    def kv(self) -> KVCache:
        return self.runner.kv

    @property
    def attn(self):
        return self.runner.attn

    def capture_graphs(self) -> None:
        """CUDA graphs of the decode / verify and draft steps over the batch ladder, one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        reserved_before = torch.cuda.memory_reserved(self.device)
        with collector_paused():
            seconds = self.runner.capture(pool)
            if self.drafter is not None:
                seconds += self.drafter.capture(pool) + self.decoding.capture()
        self.graph_capture_seconds = seconds
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        policy = getattr(self.decoding, "policy", None)
        if policy is not None and len(policy.options) > 1:  # what each option costs on this GPU
            # a plain step (PLAIN) drafts nothing; its context rows cost a few projections, not counted
            draft = {q: self.drafter.step_seconds(length=q - 1) for q in policy.lengths if q != PLAIN}
            verify = {q: self.runner.replay_seconds(q) for q in policy.lengths}
            if policy.tree:  # a tree step: its drafting with candidates; its verify, building and acceptance
                tree = self.decoding.tree
                draft[TREE] = self.drafter.step_seconds(candidates=True)
                verify[TREE] = {rung: seconds + tree.overhead_seconds(rung)
                                for rung, seconds in self.runner.replay_seconds(TREE_STEP).items()}
            for budget in policy.budgets:  # a budget step: the draft of its block's drafts; its forward
                draft[budget] = draft[budget.q]
                verify[budget] = self.runner.replay_seconds((BUDGET_STEP, *budget))
            policy.costs = StepCosts(draft, verify)
        log.info("captured CUDA graphs for batch sizes %s in %.1f s (%.0f MiB; %.0f MiB reserved)",
                 ladder_sizes(self.config.max_num_seqs), seconds, self.graph_memory_bytes / 2**20,
                 self.graph_reserve_bytes / 2**20)

    # ---- setup -------------------------------------------------------------------------------
    def _kv_dtype(self, fp8: bool) -> torch.dtype:
        if not fp8:
            return self.dtype
        allowed = (torch.bfloat16, torch.float16) if self.backend_name == "flashinfer" else (
            torch.bfloat16, torch.float16, torch.float32)
        if self.dtype not in allowed:
            raise ValueError(f"an fp8 KV cache needs the model dtype to be one of "
                             f"{', '.join(str(d).removeprefix('torch.') for d in allowed)} with the "
                             f"{self.backend_name} backend, got {self.dtype}; pass --dtype bfloat16")
        return FP8_DTYPE

    def _full_precision_layers(self, target: LoadedTarget) -> tuple[int, ...]:
        """The layers an FP8 cache leaves in the model dtype: as configured, or (auto) those whose FP8
        attention error on the calibration text stands out (specdec/models/kv_precision.py)."""
        chosen = full_precision_layer_list(self.config.kv_cache_full_precision_layers)
        num_layers = self.model.config.num_hidden_layers
        if chosen != "auto":
            if any(i >= num_layers for i in chosen):
                raise ValueError(f"kv_cache_full_precision_layers {list(chosen)} names layers the model does not have "
                                 f"(it has {num_layers}: 0 to {num_layers - 1})")
            return chosen
        errors = calibrated_fp8_errors(self.model, target.tokenizer, target.path, target.cache_dir, self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the calibration's activations must not count as used when the pool is sized
        chosen = full_precision_layers(errors)
        log.info("FP8 KV cache: layers %s kept in %s (FP8 attention error %s; median layer %.3f)",
                 list(chosen), str(self.dtype).removeprefix("torch."),
                 ", ".join(f"{errors[i]:.3f}" for i in chosen) or "-", statistics.median(errors))
        return chosen

    def _graph_memory(self, drafter) -> GraphMemory:
        """What the CUDA graphs of the target and the drafter will hold: their pools (one shared pool, but
        its blocks, cut to the target's shapes, do not always fit the drafter's steps: measured 73 MiB over
        the larger of the two on a tiny model with DFlash, so both are counted), every rung's backend
        buffers, and their page indices."""
        parts = [self.runner.graph_memory()] + ([drafter.graph_memory()] if drafter is not None else [])
        torch.cuda.empty_cache()  # the measurement's one-page caches and activations go back
        return GraphMemory(sum(p.pool for p in parts), sum(p.slots for p in parts), sum(p.per_page for p in parts))

    @property
    def graph_reserve_bytes(self) -> int:
        """Memory held back from the KV pool for the CUDA graphs (0 without graphs)."""
        return self.graph_memory.pool + self.graph_memory.slots + self.graph_memory.per_page * self.num_pages

    def _num_pages(self, drafter) -> int:
        if self.config.num_kv_pages is not None:
            return self.config.num_kv_pages
        per_page = self.runner.kv_bytes_per_page() + self.graph_memory.per_page
        if drafter is not None:  # the drafter's context cache has as many pages as the target's
            per_page += drafter.kv_bytes_per_page()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = (self.config.gpu_memory_utilization * total - (total - free) - ACTIVATION_RESERVE_BYTES
                      - self.graph_memory.pool - self.graph_memory.slots)
        else:
            budget = self.config.cpu_kv_cache_gib * (1 << 30)
        # one scratch page per cache, and the target's spare pages (its backend's own: node rows of small trees)
        pages = int(budget // per_page) - 1 - self.runner.spare_pages
        if pages < 1:
            raise ValueError("no memory is left for the KV cache after loading the model; raise "
                             "gpu_memory_utilization or set num_kv_pages explicitly")
        return pages

    # ---- requests ----------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        """A request, already finished with an error if it can never be served."""
        request = Request(self._next_id, list(prompt_ids), params, self.eos_token_ids,
                          max_total_tokens=self.max_context)
        self._next_id += 1
        problem = self.why_invalid(request.prompt_ids, params)
        if problem is None and params.structured_output is not None:
            try:
                request.matcher = self.grammars.matcher(params.structured_output)
            except ValueError as err:
                problem = str(err)
        if problem is not None:
            problem = f"request {request.request_id}: {problem}"
            log.error(problem)
            request.finish("error", problem)
        return request

    @property
    def grammars(self) -> Grammars:
        """The tokenizer as the grammars of structured output see it: built on the first such request. A model
        it cannot serve is found out once: its error is kept and raised again, not rebuilt (a second or two
        of the engine's thread) for every later request."""
        if self._grammars is None:
            try:
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
            except ValueError as err:
                self._grammars = err
        if isinstance(self._grammars, ValueError):
            raise self._grammars
        return self._grammars

    def why_invalid(self, prompt_ids: list[int], params: SamplingParams) -> str | None:
        """Why a request can never be served (None if it can)."""
        return self.limits.why_invalid(prompt_ids, params.max_new_tokens, params.logit_bias, params.stop_token_ids)

    # ---- the loop ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, lead: Request | None = None) -> Request:
        """Queue a request for the coming steps. One that can never be served comes back finished
        with an error (`finish_reason "error"`), and nothing else is touched. `lead`: an earlier request of
        the same prompt (another of its n answers), whose prompt pages this one waits for and shares."""
        if params.n != 1:
            raise ValueError(f"add_request queues one answer, got n={params.n}; add_samples queues n")
        request = self.make_request(prompt_ids, params)
        request.lead = lead
        self._queue(request)
        return request

    def make_samples(self, prompt_ids: list[int], params: SamplingParams) -> list[Request]:
        """The params.n answers of one prompt as requests (answer j seeded with seed + j); the later ones
        follow the first (`Request.lead`), so that they share its prefill."""
        samples = [self.make_request(prompt_ids, params.for_sample(j)) for j in range(params.n)]
        for sample in samples[1:]:
            sample.lead = samples[0]
        return samples

    def add_samples(self, prompt_ids: list[int], params: SamplingParams) -> list[Request]:
        """Queue the params.n answers of one prompt (`make_samples`)."""
        samples = self.make_samples(prompt_ids, params)
        for sample in samples:
            self._queue(sample)
        return samples

    @property
    def has_unfinished_requests(self) -> bool:
        return not self.scheduler.idle or self.flight is not None

    @property
    def num_waiting(self) -> int:
        """Requests queued but not yet running (the scheduler admits them as pages allow)."""
        return len(self.scheduler.waiting)

    def step(self, on_commit: OnCommit | None = None) -> StepOutput:
        """One step: one decode (or speculative) step for the requests that have finished their prefill,
        with prefill chunks for admitted requests in the same forward. Requests join and leave between
        steps."""
        on_commit = on_commit or _ignore
        start = time.perf_counter()
        # a verify queued ahead serves a step without prompt chunks: requests waiting to join take the step after it
        # (they wait one step; its verify would otherwise run for nothing)
        plan = self.scheduler.schedule(admit=self.drafter is None or self.decoding.ahead is None)
        if self.drafter is not None:
            for request in plan.preempted:
                self.drafter.release(request)
            self._adopt_cached_context(plan.admitted)
            self.decoding.room = plan.room  # what a speculative step may write past each request's length
            # nothing can join (none waits, or the batch is full): the next step runs the same requests unless one
            # ends (or one arrives meanwhile)
            self.decoding.next_step_known = not self.scheduler.can_admit
        if plan.empty and self.scheduler.waiting and self.flight is None:
            raise RuntimeError("scheduler stalled with waiting requests and nothing to run")
        out = StepOutput(preempted=plan.preempted)

        def commit(request: Request, tokens: list[int]) -> None:
            out.committed.append((request, tokens))
            on_commit(request, tokens)

        decode = plan.decode
        # penalties and grammars follow every output token on the host: a step with such a request runs in order,
        # after the step in flight has landed. With a drafter, the policy's plain steps (no draft pays at this
        # batch) run overlapped as well; a speculative step needs the tokens in flight on the host first
        adjusting = any(r.params.adjusts_logits for r in decode)  # asked once: a scan of every request
        plain = self.drafter is not None and bool(decode) and not adjusting and self.decoding.plain_pays(len(decode))
        # with a drafter, a step of prompt chunks alone is overlapped too: the next step (speculative or plain) finds
        # their first tokens as it would a plain step's, and the host prepares it while the GPU prefills
        prompts_only = self.drafter is not None and self.config.overlap_steps and not decode and bool(plan.prefill)
        if self.drafter is not None and decode:
            self.decoding.policy.ran(plain, len(decode))
        steady = self.flight is not None
        # a step that lands a forward with prompt chunks waits for their prefill: its wall time says nothing of its kind
        after_prompts = steady and self.flight.prefilled
        in_order = (self.overlap and adjusting) or (
            self.drafter is not None and not plain and not prompts_only)
        landed = in_order and steady
        if landed:
            self._overlapped([], [], commit)
            decode = [r for r in decode if not r.finished]
        if (self.overlap and not in_order) or plain or prompts_only:
            self._overlapped(decode, plan.prefill, commit)
        elif decode:  # prompt chunks ride along in the decode forward: an arrival never stalls the batch
            self._decode(decode, commit, plan.prefill)
        elif plan.prefill:
            self._prefill(plan.prefill, commit)
        if self.prefix_cache is not None:
            self._cache_committed_pages(self.scheduler.running)
        out.finished = self._retire()
        if self.drafter is not None and decode and not plan.prefill and not after_prompts:
            # a decode-only step's wall time tells the policy what its kind takes beyond its measured cost (a steady
            # step) or what a switch costs (a step after one)
            option = PLAIN if plain else self.decoding.option
            self.decoding.policy.observe_seconds(option, len(decode), time.perf_counter() - start)
        return out

    def run(self, requests: list[Request], on_commit: OnCommit | None = None) -> None:
        """Generate until every request has finished. Failed requests never stop the others.

        An exception (a failing component, a callback's, Ctrl-C) aborts every unfinished request of
        the call and returns everything they hold before it propagates: the engine is left as clean as
        before the call, and each request keeps what it had committed."""
        try:
            for request in requests:
                self._queue(request)
            while self.has_unfinished_requests:
                self.step(on_commit)
        except BaseException:
            in_flight = self.flight.drop() if self.flight is not None else []
            self.flight = None
            called = {id(r) for r in requests}
            self.abort_all([*requests, *(r for r in in_flight if id(r) not in called)])
            raise

    def reset_prefix_cache(self) -> int:
        """Drop every cached page no request holds (the target's KV and the drafter's context), so that later prompts
        prefill whole until the cache fills again, as on a fresh engine; pages a running request holds stay cached.
        Returns how many pages of the target's KV were dropped (0 without a prefix cache). Call between steps."""
        return self.prefix_cache.drop_unheld() if self.prefix_cache is not None else 0

    def abort(self, request_id: int, reason: str = "abort") -> Request | None:
        """Finish a waiting or running request as aborted (or with `reason`: "stop" when its caller found
        a stop string) and give back its pages at once; None if no such request is unfinished. Call
        between steps."""
        request = self.scheduler.find(request_id)
        if request is None or request.finished:
            return None
        self.abort_all([request], reason, INTERRUPTED if reason == "abort" else None)
        return request

    def abort_all(self, requests: list[Request] | None = None, reason: str = "abort",
                  message: str | None = INTERRUPTED) -> list[Request]:
        """Finish every unfinished request of `requests` (default: all the engine holds) with `reason` and
        give back all they hold; returns the requests it finished."""
        if requests is None:
            requests = [*self.scheduler.running, *self.scheduler.waiting]
        ended = [r for r in requests if not r.finished]
        for request in ended:
            request.finish(reason, message)
        if self.flight is not None and all(r.finished for r in self.flight.requests):
            self.flight.drop()  # the step in flight has nothing left to commit
            self.flight = None
        self.scheduler.drop_finished_waiting()
        self._retire()
        if self.drafter is not None:  # a request preempted inside a failed step may still hold drafter state
            for request in ended:
                self.drafter.release(request)
        return ended

    def _queue(self, request: Request) -> None:
        """Hand a request to the scheduler, prepared (one refused up front stays out)."""
        if not request.finished:
            self._prepare(request)
            self.scheduler.add(request)

    def _prepare(self, request: Request) -> None:
        # its length at most: attention at batch 1 cuts the KV into chunks by it, the same at every step, so a
        # verify's rows are a decode's bits (`BatchLayout.query_rows`)
        request.target_pages = PageTable(self.pool, self.limits.most_tokens(len(request.prompt_ids),
                                                                            request.params.max_new_tokens))
        if self.drafter is not None:
            request.stats.block_size = self.drafter.block_size
        if not request.params.greedy:
            request.generator = make_generator(request.params.seed)
        if request.params.stop:
            request.use_detokenizer(self.tokenizer)

    # ---- the prefix cache ----------------------------------------------------------------------
    def _adopt_cached_context(self, admitted: list[Request]) -> None:
        """The drafter's context cache starts with the cached pages the scheduler found for the target's."""
        if self.prefix_cache is None or len(self.prefix_cache.pools) < 2:
            return
        for request in admitted:
            if request.prefix_chain:
                self.drafter.adopt_context(request, self.prefix_cache.pool_pages(request.prefix_chain, 1),
                                           request.num_cached)

    def _cache_committed_pages(self, requests: list[Request]) -> None:
        """Every full page of committed tokens whose K/V (and drafter context) are written enters the
        prefix cache, once per request. A token in flight is not known yet: only committed ones count."""
        cache, ps = self.prefix_cache, self.config.page_size
        with_context = len(cache.pools) > 1
        for request in requests:
            # most steps add no full page: a request whose cache does not yet reach past its next page is passed
            # over at the cost of one comparison (the checks below took twice the time, 0.12 ms a step at 256)
            chain = request.prefix_chain
            next_page_end = (len(chain) + 1) * ps
            if request.target_pages.length < next_page_end:
                continue
            context = self.drafter.context_table(request) if with_context else None
            # the drafter's context lags the target's by the rows plain steps hold (up to 8 steps' worth): until it
            # reaches the page too, one lookup more passes the request over
            if with_context and (context is None or context.length < next_page_end):
                continue
            if request.finish_reason == "error":  # a failed request's cache rows are not trusted
                continue
            known = min(request.num_cached, len(request.prompt_ids) + len(request.output_ids))
            if with_context:
                known = min(known, context.length)
            for page in range(len(chain), known // ps):
                pages = (int(request.target_pages.array[page]),) + (
                    (int(context.array[page]),) if with_context else ())
                chain.append(cache.insert(chain[-1] if chain else None,
                                          tuple(request.token_slice(page * ps, (page + 1) * ps)), pages))

    def _retire(self) -> list[Request]:
        done = [r for r in self.scheduler.running if r.finished]
        for request in done:
            # out of the running set first: a failure below must not release a request twice
            self.scheduler.running.remove(request)
            request.prefix_chain = []
            request.target_pages.free()
            if self.drafter is not None:
                self.drafter.release(request)
        return done

    def commit(self, request: Request, tokens: list[int], on_commit: OnCommit,
               logprobs: list[TokenLogprob] | None = None) -> int:
        """Commit tokens (with their logprobs, when the request asked) in order until one finishes the request;
        returns how many were taken. A failure of this request alone (its stop strings, its detokenizer) fails
        only this request."""
        try:
            taken = request.commit_many(tokens, logprobs)
        except Exception as err:  # noqa: BLE001 - contained to the request; logged with its traceback
            log.exception("request %s failed while committing tokens", request.request_id)
            request.finish("error", f"request {request.request_id} failed: {type(err).__name__}: {err}")
            return 0
        on_commit(request, tokens if taken == len(tokens) else tokens[:taken])  # most requests take them all
        return taken

    # ---- forwards ----------------------------------------------------------------------------
    def forward_tokens(self, requests: list[Request], token_ids: torch.Tensor, q_lens: list[int], *,
                       logits_rows: torch.Tensor | None, feature_layers: tuple[int, ...] = ()):
        """Run the target on q_lens[i] new tokens of request i (flattened in `token_ids`), appended
        to its cache at positions num_cached.. (causal). Grows the page tables; K/V are written."""
        return self.runner.forward([r.target_pages for r in requests], token_ids, q_lens, logits_rows=logits_rows,
                                   feature_layers=feature_layers)

    def ids_tensor(self, ids) -> torch.Tensor:
        return upload(np.asarray(ids, dtype=np.int64), self.device)

    def _prefill_chunks(self, chunks: list[tuple[Request, int]]) -> tuple[PrefillChunks, list[Request]]:
        """The next `n` prefill tokens of each request, and the fresh requests whose prompt they complete:
        those get logits and sample their first token (a recomputed one already has its pending token)."""
        ids = np.concatenate([np.asarray(r.token_slice(r.num_cached, r.num_cached + n), dtype=np.int64)
                              for r, n in chunks])
        lens = [n for _, n in chunks]
        first = [i for i, (r, n) in enumerate(chunks) if not r.output_ids and r.num_cached + n == r.prefill_len]
        starting = [chunks[i][0] for i in first]
        prefill = PrefillChunks([r.target_pages for r, _ in chunks], ids, lens, (np.cumsum(lens) - 1)[first],
                                requests=[r for r, _ in chunks], starting=starting)
        if starting:
            prefill.sample_first = lambda logits: sample_rows(logits, None, starting, 1)
        self._plan_prompt_logprobs(prefill, chunks)
        return prefill, starting

    def _plan_prompt_logprobs(self, prefill: PrefillChunks, chunks: list[tuple[Request, int]]) -> None:
        """The chunk rows whose logits give the prompt logprobs a request asked for: row k of a chunk starting at
        position s predicts prompt token s + k + 1 (the row of the prompt's last token predicts the first output
        token, whose logprob is the output's)."""
        rows = []
        for (request, n), offset in zip(chunks, np.cumsum([0] + [n for _, n in chunks])):
            start, wanted = request.num_cached, request.prompt_logprobs
            if wanted is None or len(wanted) != start + 1:  # none asked, or recorded before a preemption
                continue
            count = min(n, len(request.prompt_ids) - 1 - start)
            if count > 0:
                prefill.echo_plan.append((request, len(rows), count))  # (request, its first echo row, rows)
                rows.extend(range(offset, offset + count))
        prefill.echo_rows = np.asarray(rows, dtype=np.int64)

    def _record_prompt_logprobs(self, prefill: PrefillChunks) -> None:
        """After the chunks' forward: each planned request's prompt logprobs (one host transfer)."""
        plan = prefill.echo_plan
        if not plan:
            return
        targets = [t for request, _, count in plan
                   for t in request.prompt_ids[len(request.prompt_logprobs):len(request.prompt_logprobs) + count]]
        k = max(request.params.prompt_logprobs for request, _, _ in plan)
        host = packed_logprobs(prefill.echo_logits, self.ids_tensor(targets), k).tolist()
        for request, first, count in plan:
            request.prompt_logprobs.extend(unpack(row, k, request.params.prompt_logprobs, token) for row, token in
                                           zip(host[first:first + count], targets[first:first + count]))

    def _prefill(self, chunks: list[tuple[Request, int]], on_commit: OnCommit) -> None:
        """A step with prompt chunks only: one forward over them."""
        prefill, starting = self._prefill_chunks(chunks)
        self.runner.run_prefill(prefill)
        prefill.read_first_tokens()  # set up to sample only when chunks complete prompts (`starting`)
        self._prefilled(chunks, prefill, starting, on_commit)

    def _prefilled(self, chunks: list[tuple[Request, int]], prefill: PrefillChunks, starting: list[Request],
                   on_commit: OnCommit) -> None:
        """After the chunks' forward: prompt logprobs where asked, each request of `starting` (its prompt now
        complete) commits its first token, and the drafter's context grows by the chunks' features. The first
        tokens go out before the drafter's work is launched: a streamed answer's first token waits for no more
        than the prefill (a request the commit finishes still gets its context: it is retired after the step)."""
        self._record_prompt_logprobs(prefill)
        try:
            if starting:
                tokens = prefill.first_tokens
                logprobs = [None] * len(starting)
                if wants_logprobs(starting):  # the first token's, from the prefill's last row
                    rows = LogprobRows.start(prefill.out.logits, self.ids_tensor(tokens), starting, 1)
                    logprobs = rows.read([[t] for t in tokens])
                for request, token, logprob in zip(starting, tokens, logprobs):
                    self.commit(request, [token], on_commit, logprob)
        finally:  # also when a caller's on_commit raised: the drafter's context keeps up with the target's KV
            if self.drafter is not None and not prefill.context_added:
                self.drafter.add_context([r for r, _ in chunks], prefill.out.features, prefill.lens)

    def _capture_graphs_if_due(self) -> None:
        """Graphs not captured at start-up (FP8 scales calibrated by the first prefill) before the first decode."""
        if self.use_graphs and self.graph_capture_seconds is None:
            self.capture_graphs()

    def _overlapped(self, running: list[Request], chunks: list[tuple[Request, int]], on_commit: OnCommit) -> None:
        """Queue this step (plain decoding, prompt chunks riding along), then commit the previous step's
        tokens while the GPU runs it (specdec/engine/flight.py)."""
        launched = None
        if running or chunks:
            if running:  # not before the first prefill: it may calibrate the FP8 scales the graphs bake in
                self._capture_graphs_if_due()
            prefill, starting = self._prefill_chunks(chunks) if chunks else (None, [])
            launched = Flight.launch(self.decoding, running, prefill, starting, self.flight, self.device)
            if prefill is not None:
                self._record_prompt_logprobs(prefill)  # waits for this step, only when a request asked
        previous, self.flight = self.flight, launched
        if previous is not None:
            previous.land(lambda request, token, logprob: self.commit(
                request, [token], on_commit, [logprob] if logprob is not None else None))
            self.scheduler.drop_finished_waiting()  # a request preempted with a token in flight may have ended

    def _decode(self, running: list[Request], on_commit: OnCommit,
                chunks: list[tuple[Request, int]] | None = None) -> None:
        """One decode phase for the running requests; prompt `chunks`, if any, ride along in its forward."""
        self._capture_graphs_if_due()
        prefill, starting = self._prefill_chunks(chunks) if chunks else (None, [])
        tokens = self.decoding.step(running, prefill)
        logprobs = self.decoding.logprobs or [None] * len(running)
        if prefill is not None:  # arrivals first, as in a step that prefills alone
            self._prefilled(chunks, prefill, starting, on_commit)
        speculating = self.drafter is not None
        # tokens each request verified (read once per step): a budget step's own, else the step's
        verify_lengths = ((self.decoding.request_lengths or [self.decoding.verify_length] * len(running))
                          if speculating else [None] * len(running))
        for request, committed, logprob, verify_length in zip(running, tokens, logprobs, verify_lengths):
            taken = self.commit(request, committed, on_commit, logprob)
            # acceptance length: what the step committed (0: the request failed alone while committing)
            if speculating and taken:
                stats = request.stats
                stats.acceptance_lengths.append(taken)
                stats.verify_lengths.append(verify_length)

    # ---- convenience -------------------------------------------------------------------------
    @torch.no_grad()
    def next_token_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The target's fp32 logits after `token_ids` (a throwaway prefill; pages are returned)."""
        probe = Request(-1, list(token_ids), SamplingParams(max_new_tokens=1), self.eos_token_ids)
        probe.target_pages = PageTable(self.pool)
        try:
            out = self.forward_tokens([probe], self.ids_tensor(probe.prompt_ids), [len(token_ids)],
                                      logits_rows=self.ids_tensor([len(token_ids) - 1]))
        finally:
            probe.target_pages.free()
        return out.logits[0].float()

    def generate_ids(self, prompts: list[list[int]], params: SamplingParams,
                     on_commit: OnCommit | None = None) -> list[Request]:
        requests = [r for p in prompts for r in self.make_samples(p, params)]  # n answers per prompt, in order
        start = time.perf_counter()
        self.run(requests, on_commit)
        self.last_wall_time = time.perf_counter() - start
        return requests

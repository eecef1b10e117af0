"""The drafter interface: what the speculative loop needs from any drafter.

Set-up: `attach(context)` with the narrow `DraftContext` (device, dtypes, page geometry, the target's
embedding and lm_head, where the target's features appear); with CUDA graphs, `graph_memory()`
while the engine sizes its pool; then `allocate_cache(num_pages)`, then `capture(pool)` (with graphs).
Lifecycle per request: `add_context` after each chunk of the target's prefill (with that chunk's
features), then each step `propose` a block and, after verification, `extend` with the rows of the
verify's features that the step committed; `release` when the request finishes or is preempted (a
preempted request starts again with `add_context` over its recomputed prefill). A drafter owns its
own caches; the engine owns the target's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from attention.page_pool import PagePool, PageTable
from specdec.runtime.model_runner import GraphMemory


class DraftRequest(Protocol):
    """What a drafter may read of a request (the engine's `Request` has these and more)."""

    request_id: int
    num_cached: int  # positions whose target K/V is cached: the pending token goes at this position
    pending_token: int  # the last committed token, not yet run through the target


@dataclass(frozen=True)
class DraftContext:
    device: torch.device
    dtype: torch.dtype  # the target's compute dtype
    kv_dtype: torch.dtype
    page_size: int
    backend_name: str  # attention backend, already resolved ("torch" or "flashinfer")
    max_batch: int
    max_context: int  # the target's context length
    embed_tokens: nn.Module
    lm_head: nn.Module
    calibrate_fp8_scales: bool = False
    # the target's features at a fixed address [rows, F]: a verify's block rows first, then the step's prompt
    # chunks (None on request-less set-ups)
    features: torch.Tensor | None = None
    # each block position's most likely drafts a step also gives (token trees; 0: none, drafts only), and
    # the largest batch whose steps with candidates are worth CUDA graphs (0: every batch)
    candidates: int = 0
    candidates_max_batch: int = 0
    # how many drafts a chain step may verify (q - 1 for each chain length q of the verify policy): a drafter
    # may score only those (empty: the whole block's)
    draft_lengths: tuple[int, ...] = ()
    # how many context positions before it each draft position attends (0: the whole context; `draft_window`)
    window: int = 0
    # how many of its most frequent tokens a draft step scores (0: the whole vocabulary; a drafter without a token
    # ranking always scores it whole: drafters/token_ranking.py)
    draft_vocab: int = 0
    # each draft's log-probability beside it (`Drafter.confidence`): budget steps share their verify rows by it
    confidence: bool = False


class Drafter(ABC):
    block_size: int  # tokens the target verifies per step: the anchor plus block_size - 1 drafts
    target_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter consumes
    draft_window: int = 0  # how far back its attention was trained to reach (0: any): the default `draft_window`
    proposes_candidates: bool = False  # whether `propose_candidates` gives each position's top drafts (trees)
    proposes_confidence: bool = False  # whether it gives `confidence` when attached for it (budget steps)
    # the last `propose`'s drafts' own log-probabilities [B, n] (float32, on the device), when attached with
    # `DraftContext.confidence` (None otherwise, and for drafters without them)
    confidence: torch.Tensor | None = None

    @abstractmethod
    def attach(self, context: DraftContext) -> None:
        """Take the engine's set-up (device, page size, KV dtype, ...) and build static buffers."""

    def kv_bytes_per_page(self) -> int:
        """Memory one page of the drafter's own cache takes, in the attached page size and KV dtype (0 for
        drafters without a cache)."""
        return 0

    def allocate_cache(self, num_pages: int) -> None:
        """Allocate the drafter's cache with as many pages as the target's."""

    def graph_memory(self) -> GraphMemory:
        """Memory the draft step's CUDA graphs will hold (measured before the KV pool is sized; none
        without graphs)."""
        return GraphMemory()

    def capture(self, pool) -> float:
        """Capture CUDA graphs of the draft step into `pool`; returns seconds (0 without graphs)."""
        return 0.0

    def step_seconds(self, candidates: bool = False, length: int | None = None) -> dict[int, float]:
        """GPU seconds of one draft step of `length` drafts per request (None: the whole block; with candidates:
        one of `propose_candidates`) at each CUDA-graph batch size, measured after capture (empty when not
        measured: the verify policy then counts only the target's verify)."""
        return {}

    @abstractmethod
    def add_context(self, requests: list[DraftRequest], features: torch.Tensor, lens: list[int]) -> None:
        """A prefill chunk of request i produced lens[i] rows of `features` [sum(lens), F], request by
        request: the target features of its next lens[i] positions (the first chunk starts at position
        0). `features` are rows of the buffer given at attach (`DraftContext.features`)."""

    def add_step_context(self, requests: list[DraftRequest], features: torch.Tensor,
                         lens: list[int] | None = None) -> None:
        """A plain step's forward computed the next lens[i] positions of request i (None: one each): a running
        request's next position, or a prompt chunk riding along. features [sum(lens), F], request by request. A
        drafter may hold them and write them before its next draft (`propose`, `propose_candidates`, `propose_next`,
        `catch_up`); `context_table` then lags until it does. The default writes them now."""
        self.add_context(requests, features, [1] * len(requests) if lens is None else lens)

    @abstractmethod
    def propose(self, requests: list[DraftRequest], length: int | None = None) -> torch.Tensor:
        """Draft tokens [len(requests), n] following each request's pending token: at least the first `length` of
        the block's block_size - 1 (None: all of them; a drafter may score only those asked for)."""

    def propose_candidates(self, requests: list[DraftRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block position's `DraftContext.candidates` most likely drafts following each request's
        pending token, as (log-probabilities, tokens), both [len(requests), block_size - 1, k], most
        likely first (token trees; the drafter's context advances as `propose` advances it). Static
        buffers, valid until the next step."""
        raise NotImplementedError(f"{type(self).__name__} proposes one draft per position: verify='tree' needs "
                                  "a drafter with candidates (DFlash)")

    def propose_next(self, requests: list[DraftRequest], anchors: torch.Tensor, counts: torch.Tensor,
                     rows: list[int], most: list[int], length: int | None = None, candidates: bool = False) -> bool:
        """Queue the next step's draft right after a step's forward, before its results reach the host, so that
        the GPU drafts while the host commits. On the device: request i's next anchor anchors[i], after it commits
        counts[i] positions (a verified request: its anchor and accepted drafts, whose features are the rows
        rows[i] ..; one whose prompt the step completed: 0), at most most[i]. True when queued: the caller then
        calls `settle` (not `extend`) once the counts are on the host, and the next `propose` of these requests
        gives the queued drafts, at least `length` of each (`queued_length`). False (the default): nothing was
        queued. With `candidates` the queued step also gives each position's top k, which the next
        `propose_candidates` of the same batch takes (a token tree's step queues the next one's)."""
        return False

    @property
    def queued_length(self) -> int | None:
        """How many drafts per request the draft queued by `propose_next` holds (None: none queued, or a drafter
        that scores every draft): a step that takes them verifies at most that many."""
        return None

    def drafts_ahead(self, requests: list[DraftRequest]) -> torch.Tensor | None:
        """The drafts `propose_next` queued for exactly these requests, in order ([B, queued_length], on the device,
        valid until the next draft), without taking them: the next `propose` still does. None: none queued for them
        (the default)."""
        return None

    def settle(self, requests: list[DraftRequest], counts: list[int]) -> None:
        """After `propose_next`: request i committed counts[i] positions."""
        raise NotImplementedError(f"{type(self).__name__} queues no draft ahead")

    def catch_up(self, requests: list[DraftRequest]) -> None:
        """A plain decoding step comes next (no draft; its forward overwrites the features buffer): a draft queued
        ahead is dropped, and context rows `extend` left pending are written now. After it, `add_step_context` gives
        the context of the positions the plain step computes. Nothing to do for a drafter without such state."""

    @abstractmethod
    def extend(self, requests: list[DraftRequest], features: torch.Tensor, rows: list[int], counts: list[int]) -> None:
        """Positions were committed: request i's newly committed positions (anchor and accepted
        drafts) have the target features features[rows[i] : rows[i] + counts[i]]."""

    @property
    def context_pool(self) -> PagePool | None:
        """The pool of the drafter's paged context cache, once allocated (None for drafters without one). A
        prefix cache keeps its pages beside the target's: a position's context is a function of the
        target's features there, so a cached prefix's context is as exact as its KV."""
        return None

    def context_table(self, request: DraftRequest) -> PageTable | None:
        """The request's context cache: positions 0 .. length - 1 hold written context (None if none yet)."""
        return None

    def adopt_context(self, request: DraftRequest, pages: list[int], num_tokens: int) -> None:
        """The request's context starts with cached full pages holding positions 0 .. num_tokens - 1; its
        `add_context` goes on from there."""
        raise NotImplementedError(f"{type(self).__name__} keeps no context cache to adopt pages into")

    @abstractmethod
    def release(self, request: DraftRequest) -> None:
        """The request finished or was preempted: free everything held for it (a no-op for one unknown)."""

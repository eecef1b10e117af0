"""The drafter interface: what the speculative loop needs from any drafter.

Lifecycle per request: `begin` after the target's prefill (with the prompt's features), then
each step `propose` a block and, after verification, `extend` with the features of the
positions the step committed; `release` when the request finishes. A drafter owns its own
caches; the engine owns the target's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specdec.request import Request


class Drafter(ABC):
    block_size: int  # tokens the target verifies per step: the anchor plus block_size - 1 drafts
    target_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter consumes

    @abstractmethod
    def attach(self, engine) -> None:
        """Allocate caches next to the engine's (same device, page size, page count, KV dtype)."""

    def kv_bytes_per_page(self, page_size: int, kv_dtype: torch.dtype) -> int:
        """Memory one page of the drafter's own cache takes (0 for drafters without a cache)."""
        return 0

    @abstractmethod
    def begin(self, requests: list[Request], prompt_features: list[torch.Tensor]) -> None:
        """Start requests whose target prefill produced `prompt_features[i]` [prompt_len, F]."""

    @abstractmethod
    def propose(self, requests: list[Request]) -> torch.Tensor:
        """Draft tokens [len(requests), block_size - 1] following each request's pending token."""

    @abstractmethod
    def extend(self, requests: list[Request], features: list[torch.Tensor]) -> None:
        """Positions were committed: features[i] [n_i, F] are the target features of request i's
        newly committed positions (anchor and accepted drafts), in order."""

    @abstractmethod
    def release(self, request: Request) -> None:
        """The request finished: free everything held for it."""

"""What one forward step looks like to attention: per-request query and KV lengths and pages.

Every request i in the step writes K/V for `new_kv_lens[i]` tokens, which are the last tokens
of its KV (positions kv_lens[i] - new_kv_lens[i] .. kv_lens[i] - 1), and asks `q_lens[i]`
queries, which are the last q_lens[i] of those new tokens. A target forward has
new_kv_lens == q_lens; a DFlash draft step also writes context K/V that have no query.

Causal alignment is bottom-right: query j of request i sees KV positions
<= kv_lens[i] - q_lens[i] + j. With causal=False every query sees the request's whole KV.

Flattened tensors (queries, new K/V) are ordered request by request.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True)
class BatchLayout:
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    new_kv_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    page_size: int
    causal: bool

    def __post_init__(self):
        n = len(self.q_lens)
        if not (len(self.kv_lens) == len(self.new_kv_lens) == len(self.page_tables) == n):
            raise ValueError("q_lens, kv_lens, new_kv_lens and page_tables must have one entry per request")
        for q, new, kv, pages in zip(self.q_lens, self.new_kv_lens, self.kv_lens, self.page_tables):
            if not (0 < q <= new <= kv):
                raise ValueError(f"need 0 < q_len <= new_kv_len <= kv_len, got {q}, {new}, {kv}")
            if len(pages) * self.page_size < kv:
                raise ValueError(f"{len(pages)} pages of {self.page_size} cannot hold {kv} tokens")

    @classmethod
    def for_tokens(cls, q_lens, kv_lens, page_tables, page_size: int, causal: bool) -> "BatchLayout":
        """A layout where every new token also has a query (prefill, verify, decode)."""
        return cls(tuple(q_lens), tuple(kv_lens), tuple(q_lens), tuple(map(tuple, page_tables)), page_size, causal)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_queries(self) -> int:
        return sum(self.q_lens)

    @property
    def num_new_kv(self) -> int:
        return sum(self.new_kv_lens)

    def qo_indptr(self) -> list[int]:
        return [0, *accumulate(self.q_lens)]

    def pages_used(self) -> list[int]:
        return [-(-kv // self.page_size) for kv in self.kv_lens]

    def kv_indptr(self) -> list[int]:
        return [0, *accumulate(self.pages_used())]

    def kv_indices(self) -> list[int]:
        return [p for pages, used in zip(self.page_tables, self.pages_used()) for p in pages[:used]]

    def last_page_lens(self) -> list[int]:
        return [(kv - 1) % self.page_size + 1 for kv in self.kv_lens]

    def new_kv_positions(self) -> list[int]:
        """In-sequence position of every written token, flattened."""
        return [p for kv, new in zip(self.kv_lens, self.new_kv_lens) for p in range(kv - new, kv)]

    def new_kv_slots(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of every written token, flattened, as int64 tensors on `device`."""
        pages, offsets = [], []
        for kv, new, table in zip(self.kv_lens, self.new_kv_lens, self.page_tables):
            for pos in range(kv - new, kv):
                pages.append(table[pos // self.page_size])
                offsets.append(pos % self.page_size)
        return (torch.tensor(pages, dtype=torch.long, device=device),
                torch.tensor(offsets, dtype=torch.long, device=device))

"""Page bookkeeping for the paged KV cache: plain Python over integers, no tensors.

A `PagePool` hands out fixed-size pages; a `PageTable` is one sequence's ordered list of pages
plus its length in tokens. Slot `s` of a sequence lives in page `pages[s // page_size]` at
offset `s % page_size`. Invariants (tested property-based):
- a page belongs to at most one table or to the free list, never both;
- a table holds exactly ceil(length / page_size) pages;
- truncation returns every page that lies wholly past the new length; a partly used last page stays.
"""

from __future__ import annotations

from collections import deque

import numpy as np


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages of `page_size` slots that `num_tokens` tokens occupy: ceil(num_tokens / page_size)."""
    return -(-num_tokens // page_size)


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than a request needs."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} free KV pages, only {len(self._free)} of {self.num_pages} left")
        return [self._free.popleft() for _ in range(count)]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(pages)


class PageTable:
    """One sequence's pages and length. All growth and shrinkage goes through the pool.

    Page ids live in a numpy array that grows by doubling, so a step reads a table's pages as one
    array slice (`array`) with no per-page Python work."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._ids = np.empty(4, dtype=np.int32)
        self.num_pages = 0
        self.length = 0

    @property
    def array(self) -> np.ndarray:
        """The pages in order, int32 (a view: valid until the table changes)."""
        return self._ids[:self.num_pages]

    @property
    def pages(self) -> list[int]:
        return self.array.tolist()

    def can_grow(self, num_tokens: int) -> bool:
        return self.pool.pages_for(self.length + num_tokens) - self.num_pages <= self.pool.num_free

    def grow(self, num_tokens: int) -> None:
        """Reserve slots for `num_tokens` more tokens (the caller writes their K/V)."""
        needed = self.pool.pages_for(self.length + num_tokens) - self.num_pages
        if needed > 0:
            new = self.pool.take(needed)
            end = self.num_pages + needed
            if end > len(self._ids):
                self._ids = np.resize(self._ids, max(end, 2 * len(self._ids)))
            self._ids[self.num_pages:end] = new
            self.num_pages = end
        self.length += num_tokens

    def truncate(self, length: int) -> None:
        """Shrink to `length` tokens, returning the whole pages past it to the pool."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        keep = self.pool.pages_for(length)
        if keep < self.num_pages:
            self.pool.give_back(self._ids[keep:self.num_pages].tolist())
            self.num_pages = keep
        self.length = length

    def free(self) -> None:
        self.truncate(0)

    def slot(self, position: int) -> int:
        """Flat slot index (page * page_size + offset) of token `position`."""
        return int(self._ids[position // self.pool.page_size]) * self.pool.page_size + position % self.pool.page_size

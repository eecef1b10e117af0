"""Page bookkeeping for the paged KV cache: plain Python over integers, no tensors.

A `PagePool` hands out fixed-size pages; a `PageTable` is one sequence's ordered list of pages
plus its length in tokens. Slot `s` of a sequence lives in page `pages[s // page_size]` at
offset `s % page_size`. A page is counted by the tables that hold it: a prefix cache
(`attention/prefix_cache.py`) lets tables share the full pages of a common prefix (`PageTable.adopt`), and
keeps a page no table holds any more until the pool needs it back. Invariants (tested property-based):
- a page is free, or held by the tables counted in its reference count, or kept by the prefix cache with
  no reference, never two of these;
- a table holds exactly ceil(length / page_size) pages;
- truncation returns every page that lies wholly past the new length; a partly used last page stays;
- a shared page is never written: only full pages are shared, and a table writes past its length.
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
        self._refs = [0] * num_pages  # tables holding each page
        self.keeper = None  # a PrefixCache keeping unreferenced pages of cached prefixes (None: no caching)

    @property
    def num_free(self) -> int:
        """Pages a request can take: the free ones and those the prefix cache keeps but nobody holds."""
        return len(self._free) + (self.keeper.num_evictable if self.keeper is not None else 0)

    @property
    def num_referenced(self) -> int:
        """Pages some table holds."""
        return sum(1 for refs in self._refs if refs)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return pages_for(num_tokens, self.page_size)

    def take(self, count: int) -> list[int]:
        if count > len(self._free) and self.keeper is not None:
            self.keeper.evict(count - len(self._free))  # the least recently used cached pages come back
        if count > len(self._free):
            raise OutOfPagesError(f"need {count} free KV pages, only {len(self._free)} of {self.num_pages} left")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages) -> None:
        """One more table holds each of `pages` (cached pages a new sequence starts with)."""
        refs = self._refs
        unheld = [page for page in pages if refs[page] == 0]  # kept by the prefix cache for nobody until now
        for page in pages:
            refs[page] += 1
        if unheld:
            self.keeper.reused(self, unheld)

    def give_back(self, pages) -> None:
        """One table fewer holds each of `pages`. The last holder's page goes to the free list, or stays with
        the prefix cache when it holds cached tokens. Given back last page first, so that a cache evicting
        least recently used pages drops a prefix's tail before its head."""
        refs, kept, released = self._refs, self.keeper.kept(self) if self.keeper is not None else {}, []
        for page in reversed(pages):
            left = refs[page] - 1
            if left < 0:
                raise RuntimeError(f"KV page {page} given back more often than it was taken")
            refs[page] = left
            if left == 0:
                if page in kept:
                    released.append(page)
                else:
                    self._free.append(page)
        if released:
            self.keeper.released(self, released)

    def put_free(self, page: int) -> None:
        """An unreferenced page the prefix cache lets go of."""
        self._free.append(page)


def grow_tables(tables: list["PageTable"], counts: list[int]) -> None:
    """`PageTable.grow` of each of `tables` (distinct tables of one pool) by its count, the pages they need taken from
    the pool in one call (a step that holds one context row per request grows hundreds of tables at once). No table
    changes when the pool has too few pages."""
    if not tables:
        return
    pool, page_size = tables[0].pool, tables[0].pool.page_size
    lengths = [table.length + count for table, count in zip(tables, counts)]
    needs = [pages_for(length, page_size) - table.num_pages for table, length in zip(tables, lengths)]
    taken = pool.take(sum(n for n in needs if n > 0))
    start = 0
    for table, length, need in zip(tables, lengths, needs):
        if need > 0:
            table._extend(taken[start:start + need], length)
            start += need
        else:
            table.length = length


def table_lengths(tables: list["PageTable"]) -> np.ndarray:
    """The tables' lengths (int64), read in one pass."""
    return np.fromiter((t.length for t in tables), dtype=np.int64, count=len(tables))


def pool_holds(tables: list["PageTable"], lengths: np.ndarray) -> bool:
    """Whether the pool has the pages `tables` (distinct tables of one pool) need to grow to `lengths` (a verify queued
    ahead takes them before the scheduler plans the step it serves)."""
    pool = tables[0].pool
    held = np.fromiter((t.num_pages for t in tables), dtype=np.int64, count=len(tables))
    return int(np.clip(-(-np.asarray(lengths) // pool.page_size) - held, 0, None).sum()) <= pool.num_free


class PageTable:
    """One sequence's pages and length. All growth and shrinkage goes through the pool.

    Page ids live in a numpy array that grows by doubling, so a step reads a table's pages as one
    array slice (`array`) with no per-page Python work."""

    def __init__(self, pool: PagePool, expected_length: int = 0):
        """expected_length: the most tokens the sequence should come to hold (prompt and answer; 0: unknown), by
        which attention may cut a lone sequence's KV into chunks the same way at every step."""
        self.pool = pool
        self._ids = np.empty(4, dtype=np.int32)
        self.num_pages = 0
        self.length = 0
        self.expected_length = expected_length

    @property
    def array(self) -> np.ndarray:
        """The pages in order, int32 (a view: valid until the table changes)."""
        return self._ids[:self.num_pages]

    @property
    def pages(self) -> list[int]:
        return self.array.tolist()

    def adopt(self, pages: list[int], num_tokens: int) -> None:
        """Start an empty table with shared full pages holding its first `num_tokens` tokens (a cached prefix)."""
        if self.num_pages or self.length:
            raise ValueError("only an empty table can adopt cached pages")
        if num_tokens != len(pages) * self.pool.page_size:
            raise ValueError(f"{len(pages)} cached pages hold {len(pages) * self.pool.page_size} tokens, not {num_tokens}")
        self.pool.share(pages)
        self._ids = np.resize(self._ids, max(len(pages), len(self._ids)))
        self._ids[:len(pages)] = pages
        self.num_pages = len(pages)
        self.length = num_tokens

    def can_grow(self, num_tokens: int) -> bool:
        return self.pool.pages_for(self.length + num_tokens) - self.num_pages <= self.pool.num_free

    def grow(self, num_tokens: int) -> None:
        """Reserve slots for `num_tokens` more tokens (the caller writes their K/V)."""
        length = self.length + num_tokens
        if length <= self.num_pages * self.pool.page_size:  # room in the pages held: a step's usual case
            self.length = length
            return
        self._extend(self.pool.take(self.pool.pages_for(length) - self.num_pages), length)

    def _extend(self, new: list[int], length: int) -> None:
        """Append pages `new` (taken for this table) and set the length they make room for."""
        end = self.num_pages + len(new)
        if end > len(self._ids):
            self._ids = np.resize(self._ids, max(end, 2 * len(self._ids)))
        self._ids[self.num_pages:end] = new
        self.num_pages = end
        self.length = length

    def append(self) -> tuple[int, int]:
        """Grow by one token: its position and page. A step that writes one token per sequence stages it from this
        alone; most appends land in a page the table holds, with no allocation."""
        position = self.length
        self.grow(1)
        return position, int(self._ids[position // self.pool.page_size])

    def truncate(self, length: int, room: int = 0) -> None:
        """Shrink to `length` tokens, returning the whole pages past it to the pool, but for those of `room` more
        slots: a step that writes past the committed length and rolls back keeps what its next step takes again
        (the scheduler plans that many slots ahead for a running request anyway), so the pool is not asked for
        the same pages back at every step."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a sequence of {self.length} tokens to {length}")
        if length + room > (self.num_pages - 1) * self.pool.page_size:  # nothing past the room to give back
            self.length = length
            return
        keep = self.pool.pages_for(length + room)
        self.pool.give_back(self._ids[keep:self.num_pages].tolist())
        self.num_pages = keep
        self.length = length

    def free(self) -> None:
        self.truncate(0)

    def slot(self, position: int) -> int:
        """Flat slot index (page * page_size + offset) of token `position`."""
        return int(self._ids[position // self.pool.page_size]) * self.pool.page_size + position % self.pool.page_size

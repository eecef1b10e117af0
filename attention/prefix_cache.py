"""Prefix caching: full pages of committed tokens, kept and shared between sequences.

A cached page is keyed by its tokens and the cached page before it (a chain of pages, as a radix tree of
page-sized edges): two sequences share page i exactly when their first (i + 1) * page_size tokens are
equal. An entry holds one page in each pool it covers (the target's KV, and the drafter's context cache
whose rows at a position are a function of the target's features there, so they are cached alike), and
is taken and evicted as a unit.

Life of an entry:
- `insert`: a sequence's full page of committed tokens, whose K/V (and drafter context) are written, enters
  the cache; the sequence keeps holding it. A page equal to one already cached stays the sequence's own.
- `match`: a new sequence finds the longest cached chain of its tokens; `PageTable.adopt` shares those
  pages (reference counts in the pools), so the sequence prefills only what follows.
- when no table holds an entry's pages any more, the pools leave them with the cache (`released`): they
  count as free, and `evict` returns the least recently released ones to the free lists when a pool runs
  short. A sequence that adopts an entry again takes it off that list (`reused`).
- `drop_unheld`: every entry nobody holds goes back at once (a reset: later prompts prefill whole).
Pure bookkeeping over integers: no tensors, nothing is copied.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import count

from attention.page_pool import PagePool


@dataclass(eq=False)
class CachedPage:
    key: tuple  # (the parent entry's id, the page's tokens)
    pages: tuple[int, ...]  # one page per pool, in the cache's pool order
    id: int
    holders: int = 0  # pool pages of this entry some table holds


class PrefixCache:
    def __init__(self, pools: list[PagePool]):
        if not pools or len({p.page_size for p in pools}) != 1:
            raise ValueError("a prefix cache needs one or more pools of one page size")
        self.pools = pools
        self.page_size = pools[0].page_size
        self._entries: dict[tuple, CachedPage] = {}
        self._by_page = [dict() for _ in pools]  # per pool: page -> its entry
        self._evictable: OrderedDict[int, CachedPage] = OrderedDict()  # id -> entry nobody holds, oldest first
        self._ids = count(1)  # 0 is the root's
        for pool in pools:
            if pool.keeper is not None:
                raise ValueError("a pool can belong to one prefix cache only")
            pool.keeper = self
        self.hit_tokens = 0  # prompt tokens found at first admissions, over the cache's life

    @property
    def num_cached(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    # ---- lookup --------------------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> list[CachedPage]:
        """The longest chain of cached full pages that `tokens` starts with (no side effects)."""
        chain, parent, ps = [], 0, self.page_size
        for start in range(0, len(tokens) - ps + 1, ps):
            entry = self._entries.get((parent, tuple(tokens[start:start + ps])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        return chain

    def pool_pages(self, chain: list[CachedPage], pool: int) -> list[int]:
        return [entry.pages[pool] for entry in chain]

    def cached_pages(self, pool: int) -> set[int]:
        """Pages of pool `pool` (its index in `pools`) the cache has entries for."""
        return set(self._by_page[pool])

    def evictable_among(self, chain: list[CachedPage]) -> int:
        """Entries of `chain` nobody holds: adopting them takes them out of the free count."""
        return sum(1 for entry in chain if entry.holders == 0)

    # ---- insertion -----------------------------------------------------------------------------------
    def insert(self, parent: CachedPage | None, tokens: tuple[int, ...], pages: tuple[int, ...]) -> CachedPage:
        """Cache a full page of committed tokens following `parent` (None: the first page), held by the
        sequence that wrote it; returns the entry (an equal one already cached, if any)."""
        if len(tokens) != self.page_size or len(pages) != len(self.pools):
            raise ValueError(f"a cached page holds {self.page_size} tokens and one page per pool "
                             f"({len(self.pools)}), got {len(tokens)} tokens and {len(pages)} pages")
        key = (parent.id if parent is not None else 0, tokens)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if any(page in by_page for page, by_page in zip(pages, self._by_page)):
            raise ValueError(f"pages {pages} are cached already under other tokens")
        entry = CachedPage(key, pages, next(self._ids))
        for i, (page, pool) in enumerate(zip(pages, self.pools)):
            if pool.refs(page) == 0:
                raise ValueError(f"page {page} is not held by the sequence caching it")
            self._by_page[i][page] = entry
            entry.holders += 1
        self._entries[key] = entry
        return entry

    # ---- the pools' side -----------------------------------------------------------------------------
    def kept(self, pool: PagePool) -> dict[int, CachedPage]:
        """The pages of `pool` the cache has entries for (page -> entry; read, never changed, by the pool)."""
        return self._by_page[self.pools.index(pool)]

    def released(self, pool: PagePool, pages: list[int]) -> None:
        """The last tables holding these cached pages gave them back (the first given back is evicted first)."""
        by_page, evictable = self.kept(pool), self._evictable
        for page in pages:
            entry = by_page[page]
            entry.holders -= 1
            if entry.holders == 0:
                evictable[entry.id] = entry

    def reused(self, pool: PagePool, pages: list[int]) -> None:
        """Tables adopt these cached pages, which nobody held."""
        by_page, evictable = self.kept(pool), self._evictable
        for page in pages:
            entry = by_page[page]
            if entry.holders == 0:
                del evictable[entry.id]
            entry.holders += 1

    def evict(self, count: int) -> int:
        """Return up to `count` entries nobody holds to the pools, least recently released first; returns
        how many. An evicted entry's descendants stay until evicted in turn (no lookup reaches them)."""
        evicted = 0
        while evicted < count and self._evictable:
            _, entry = self._evictable.popitem(last=False)
            del self._entries[entry.key]
            for page, pool, by_page in zip(entry.pages, self.pools, self._by_page):
                del by_page[page]
                pool.put_free(page)
            evicted += 1
        return evicted

    def drop_unheld(self) -> int:
        """Return every entry nobody holds to the pools (entries a table holds stay cached); returns how many."""
        return self.evict(len(self._evictable))

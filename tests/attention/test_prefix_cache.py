"""Prefix cache bookkeeping: shared pages are counted, kept and evicted without a page leaked or shared wrongly."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.page_pool import OutOfPagesError, PagePool, PageTable
from attention.prefix_cache import PrefixCache


def cache_full_pages(cache: PrefixCache, table: PageTable, tokens: list[int], chain: list) -> None:
    """What the engine does after a step: each full page of the table's tokens enters the cache once."""
    ps = cache.page_size
    for page in range(len(chain), table.length // ps):
        chain.append(cache.insert(chain[-1] if chain else None, tuple(tokens[page * ps:(page + 1) * ps]),
                                  (int(table.array[page]),)))


def test_a_second_sequence_shares_the_cached_pages_of_its_prefix():
    pool = PagePool(8, 2)
    cache = PrefixCache([pool])
    first, chain = PageTable(pool), []
    first.grow(5)
    cache_full_pages(cache, first, [1, 2, 3, 4, 5], chain)
    assert cache.num_cached == 2  # the partly filled third page is not cached
    hit = cache.match([1, 2, 3, 4, 9, 9])
    assert [e.pages[0] for e in hit] == first.pages[:2]
    assert cache.match([1, 2, 7, 4]) == hit[:1]  # a prefix diverging in page 1 shares page 0 only
    second = PageTable(pool)
    second.adopt(cache.pool_pages(hit, 0), 4)
    assert pool.refs(first.pages[0]) == 2 and second.length == 4
    second.grow(2)  # writes go to a page of its own
    assert second.pages[2] not in first.pages
    first.free()
    assert pool.num_referenced == 3  # the shared pages and its own: held by the second table
    second.free()
    assert pool.num_referenced == 0 and pool.num_free == 8 and cache.num_evictable == 2


def test_unheld_cached_pages_are_evicted_least_recently_released_first_when_the_pool_runs_short():
    pool = PagePool(4, 2)
    cache = PrefixCache([pool])
    tables = []
    for tokens in ([1, 2], [3, 4]):
        table, chain = PageTable(pool), []
        table.grow(2)
        cache_full_pages(cache, table, tokens, chain)
        tables.append(table)
    tables[0].free()
    tables[1].free()
    assert pool.num_free == 4 and cache.num_evictable == 2
    taker = PageTable(pool)
    taker.grow(7)  # 4 pages: both cached pages come back, [1, 2] (released first) before [3, 4]
    assert cache.num_cached == 0 and cache.match([3, 4, 0]) == []
    with pytest.raises(OutOfPagesError):
        taker.grow(2)


def test_dropping_the_unheld_entries_frees_them_and_keeps_the_held_ones():
    pool = PagePool(8, 2)
    cache = PrefixCache([pool])
    held, kept_chain = PageTable(pool), []
    held.grow(4)
    cache_full_pages(cache, held, [1, 2, 3, 4], kept_chain)
    gone, gone_chain = PageTable(pool), []
    gone.grow(4)
    cache_full_pages(cache, gone, [5, 6, 7, 8], gone_chain)
    gone.free()
    assert cache.num_cached == 4 and cache.num_evictable == 2
    assert cache.drop_unheld() == 2
    assert cache.match([5, 6, 7, 8]) == [] and cache.num_evictable == 0
    assert [e.pages[0] for e in cache.match([1, 2, 3, 4])] == held.pages  # a table holds them: still cached
    assert pool.num_free == 6 and cache.drop_unheld() == 0
    held.free()  # released afterwards: cached and unheld until dropped in turn
    assert cache.drop_unheld() == 2 and cache.num_cached == 0 and pool.num_free == 8 and pool.num_referenced == 0


def test_adopting_an_unheld_entry_takes_it_out_of_the_free_count():
    pool = PagePool(3, 2)
    cache = PrefixCache([pool])
    table, chain = PageTable(pool), []
    table.grow(2)
    cache_full_pages(cache, table, [5, 6], chain)
    table.free()
    hit = cache.match([5, 6, 7])
    assert cache.evictable_among(hit) == 1 and pool.num_free == 3
    again = PageTable(pool)
    again.adopt(cache.pool_pages(hit, 0), 2)
    assert pool.num_free == 2 and cache.num_evictable == 0


def test_an_equal_page_cached_twice_keeps_one_entry_and_the_copy_stays_private():
    pool = PagePool(4, 2)
    cache = PrefixCache([pool])
    a, b, chain_a, chain_b = PageTable(pool), PageTable(pool), [], []
    a.grow(2)
    b.grow(2)
    cache_full_pages(cache, a, [1, 2], chain_a)
    cache_full_pages(cache, b, [1, 2], chain_b)
    assert chain_a == chain_b and cache.num_cached == 1
    b.free()  # its copy was never cached: straight back to the free list
    assert b.pages == [] and cache.num_evictable == 0 and pool.num_free == 3


def test_entries_span_pools_and_are_evicted_together():
    target, drafter = PagePool(4, 2), PagePool(4, 2)
    cache = PrefixCache([target, drafter])
    t, d = PageTable(target), PageTable(drafter)
    t.grow(2)
    d.grow(2)
    entry = cache.insert(None, (1, 2), (t.pages[0], d.pages[0]))
    t.free()
    assert cache.num_evictable == 0  # the drafter's page is still held
    d.free()
    assert cache.num_evictable == 1 and drafter.num_free == 4
    PageTable(drafter).grow(8)  # the drafter's pool takes all four: the entry goes, the target's page too
    assert cache.num_cached == 0 and target.num_free == 4 and entry.pages[0] in target._free


def test_misuse_is_refused():
    pool = PagePool(4, 2)
    cache = PrefixCache([pool])
    with pytest.raises(ValueError, match="a pool can belong to one prefix cache"):
        PrefixCache([pool])
    with pytest.raises(ValueError, match="holds 2 tokens"):
        cache.insert(None, (1, 2, 3), (0,))
    with pytest.raises(ValueError, match="not held"):
        cache.insert(None, (1, 2), (0,))
    table = PageTable(pool)
    table.grow(1)
    with pytest.raises(ValueError, match="only an empty table"):
        table.adopt([1], 2)
    with pytest.raises(ValueError, match="same page size|one page size"):
        PrefixCache([PagePool(2, 2), PagePool(2, 4)])


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "truncate", "free", "cache"]), st.integers(0, 10**6),
                         st.integers(0, 12)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(2, 24), ops)
def test_random_sharing_keeps_every_page_accounted_for(page_size, num_pages, operations):
    """Sequences over a small vocabulary (so prefixes repeat) start from cached prefixes, grow, roll back
    and end; reference counts always equal the tables holding a page, a shared page is always full and
    below every holder's length, and each page is exactly one of free, held or cached."""
    pool = PagePool(num_pages, page_size)
    cache = PrefixCache([pool])
    live: list[tuple[PageTable, list[int], list]] = []  # (table, its tokens, its cache chain)
    seen: list[list[int]] = []  # every sequence's tokens so far: new ones often start with one of them
    for op, pick, amount in operations:
        if op == "new" or not live:
            base = list(seen[pick % len(seen)][:amount + page_size]) if seen and pick % 4 else []
            tokens = base + [(pick >> 3) % 2] * amount
            seen.append(tokens)
            hit = cache.match(tokens[:max(len(tokens) - 1, 0)])
            if cache.evictable_among(hit) > pool.num_free - pool.pages_for(len(tokens)) + len(hit):
                continue
            table = PageTable(pool)
            table.adopt(cache.pool_pages(hit, 0), len(hit) * page_size)
            live.append((table, tokens, list(hit)))
            if table.can_grow(len(tokens) - table.length):  # its prefill, cached as the engine caches it
                table.grow(len(tokens) - table.length)
                cache_full_pages(cache, table, tokens, live[-1][2])
            continue
        table, tokens, chain = live[pick % len(live)]
        if op == "grow":
            n = min(amount, len(tokens) - table.length) if len(tokens) > table.length else amount
            if table.can_grow(n):
                tokens.extend(pick % 3 for _ in range(table.length + n - len(tokens)))
                table.grow(n)
        elif op == "truncate":
            keep = max(len(chain) * page_size, table.length - amount)
            table.truncate(keep)  # rollback never goes below what the chain covers
            del tokens[max(keep, len(chain) * page_size):]
        elif op == "cache":
            cache_full_pages(cache, table, tokens, chain)
        else:
            table.free()
            live.remove((table, tokens, chain))
        holders = {}
        for t, _, _ in live:
            for p in t.pages:
                holders[p] = holders.get(p, 0) + 1
        assert all(pool.refs(p) == holders.get(p, 0) for p in range(num_pages))
        for t, _, c in live:
            shared = [p for p in t.pages if holders[p] > 1]
            assert all(t.pages.index(p) < t.length // page_size for p in shared), "a shared page is not full"
            assert all(t.pages.index(p) < len(c) for p in shared)
        free = list(pool._free)
        cached = cache.cached_pages(0)
        assert len(free) == len(set(free)) and not set(free) & (cached | set(holders))
        assert len(free) + len(cached | set(holders)) == num_pages
        assert pool.num_free == len(free) + cache.num_evictable
    for table, _, _ in live:
        table.free()
    assert pool.num_referenced == 0 and pool.num_free == num_pages

"""Page bookkeeping: random allocate / grow / truncate / free never leaks or shares a page."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.page_pool import OutOfPagesError, PagePool, PageTable, grow_tables, pool_holds

ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "truncate", "free"]), st.integers(0, 10**6),
                         st.integers(0, 40)), max_size=200)


def check_invariants(pool: PagePool, tables: list[PageTable]) -> None:
    owned = [p for t in tables for p in t.pages]
    assert len(owned) == len(set(owned)), "a page is shared by two sequences"
    assert not set(owned) & set(pool._free), "a page is both owned and free"
    assert len(owned) + pool.num_free == pool.num_pages, "a page was lost"
    for t in tables:
        assert len(t.pages) >= pool.pages_for(t.length)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.integers(1, 64), ops)
def test_random_operations_keep_pages_consistent(page_size, num_pages, operations):
    pool = PagePool(num_pages, page_size)
    tables: list[PageTable] = []
    for op, pick, amount in operations:
        if op == "new" or not tables:
            tables.append(PageTable(pool))
            continue
        table = tables[pick % len(tables)]
        if op == "grow":
            if table.can_grow(amount):
                table.grow(amount)
            else:
                before = (list(table.pages), table.length, pool.num_free)
                try:
                    table.grow(amount)
                except OutOfPagesError:
                    pass
                assert (list(table.pages), table.length, pool.num_free) == before
        elif op == "truncate":
            new_len, room, held = amount % (table.length + 1), pick % 9, len(table.pages)
            table.truncate(new_len, room)
            assert table.length == new_len
            # the pages past the room go back; those within it stay (none is taken)
            assert len(table.pages) == min(held, pool.pages_for(new_len + room))
        else:
            table.free()
            tables.remove(table)
        check_invariants(pool, tables)
    for t in tables:
        t.free()
    assert pool.num_free == pool.num_pages


def test_truncate_keeps_partly_used_last_page():
    pool = PagePool(10, 4)
    t = PageTable(pool)
    t.grow(10)  # 3 pages
    t.truncate(5)  # 2 pages, the second partly used
    assert len(t.pages) == 2 and t.length == 5 and pool.num_free == 8
    t.truncate(4)
    assert len(t.pages) == 1 and pool.num_free == 9


def test_truncate_keeps_the_pages_of_its_room_and_a_later_grow_takes_them_again():
    pool = PagePool(10, 4)
    t = PageTable(pool)
    t.grow(5)
    t.grow(4)  # a verify of 4 past 5 tokens: 3 pages
    pages = t.pages
    t.truncate(6, room=4)  # 6 tokens and room for 4 more: the 3 pages stay
    assert t.pages == pages and t.length == 6 and pool.num_free == 7
    t.grow(4)  # the next verify writes there again, with no page from the pool
    assert t.pages == pages and pool.num_free == 7
    t.truncate(6, room=1)  # room for 1 more: 2 pages
    assert t.pages == pages[:2] and pool.num_free == 8
    t.free()
    assert pool.num_free == 10


def test_slot_addresses_follow_pages():
    pool = PagePool(10, 4)
    a, b = PageTable(pool), PageTable(pool)
    a.grow(3)
    b.grow(5)
    a.grow(3)
    assert [a.slot(i) // 4 for i in range(6)] == [a.pages[0]] * 4 + [a.pages[1]] * 2
    assert len({a.slot(i) for i in range(6)} | {b.slot(i) for i in range(5)}) == 11


def test_append_gives_the_slot_growing_by_one_would():
    """A table appended to token by token (from empty, from a shared prefix, after a truncation inside a page) holds
    the pages, length and slots that growing it by one token at a time gives."""
    for start in ("empty", "adopted", "truncated"):
        pools = [PagePool(32, 4) for _ in range(2)]
        appended, grown = (PageTable(pool) for pool in pools)
        if start == "adopted":
            for pool, table in zip(pools, (appended, grown)):
                table.adopt(pool.take(2), 8)
        if start == "truncated":
            for table in (appended, grown):
                table.grow(7)
                table.truncate(5)
        for _ in range(11):
            position, page = appended.append()
            grown.grow(1)
            assert position == grown.length - 1 == appended.length - 1, start
            assert page * 4 + position % 4 == grown.slot(position) == appended.slot(position), start
        assert appended.pages == grown.pages, start


def test_growing_tables_together_is_growing_each_and_changes_nothing_when_pages_run_out():
    pool, reference_pool = PagePool(40, 4), PagePool(40, 4)
    lengths, counts = [0, 3, 4, 9, 13], [1, 1, 5, 3, 0]
    tables, reference = [PageTable(pool) for _ in lengths], [PageTable(reference_pool) for _ in lengths]
    for table, ref, length in zip(tables, reference, lengths):
        table.grow(length)
        ref.grow(length)
    grow_tables(tables, counts)
    for ref, count in zip(reference, counts):
        ref.grow(count)
    assert [(t.length, t.num_pages) for t in tables] == [(t.length, t.num_pages) for t in reference]
    assert pool.num_free == reference_pool.num_free
    assert all(len(set(t.pages)) == t.num_pages for t in tables)  # each its own pages
    before = [(t.length, t.num_pages, t.pages) for t in tables], pool.num_free
    with pytest.raises(OutOfPagesError):
        grow_tables(tables, [4 * 40] * len(tables))
    assert ([(t.length, t.num_pages, t.pages) for t in tables], pool.num_free) == before


def test_pool_holds_counts_the_pages_tables_lack_for_their_lengths_against_the_free_ones():
    """`pool_holds`: the pages the tables lack for the lengths asked, against the pool's free ones."""
    pool = PagePool(5, 4)
    tables = [PageTable(pool), PageTable(pool)]
    tables[0].grow(6)  # 2 pages
    tables[1].grow(3)  # 1 page; 2 left
    assert pool_holds(tables, np.array([8, 8]))  # 0 + 1 more
    assert pool_holds(tables, np.array([12, 8]))  # 1 + 1
    assert not pool_holds(tables, np.array([13, 8]))  # 2 + 1

"""DFlash's held context rows (plain steps' rows, written together): each row is staged at the position and page that
appending the rows one by one, in the order they were held, gives."""

import random

import numpy as np

from attention.page_pool import PagePool, PageTable
from drafters.dflash import DFlashDrafter


class StagedPlaces:
    """What `_stage_held` needs of a drafter: its page size and where the staged places go."""

    page_size = 4
    context_step = None

    def stage_token_places(self, step, positions, pages, offsets) -> int:
        self.places = [np.asarray(a).tolist() for a in (positions, pages, offsets)]
        return len(positions)


def tables_at(lengths: list[int], pool: PagePool) -> list[PageTable]:
    tables = [PageTable(pool) for _ in lengths]
    for table, length in zip(tables, lengths):
        table.grow(length)
    return tables


def test_held_rows_take_the_places_of_appending_them_row_by_row():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randrange(0, 13) for _ in range(rng.randrange(1, 7))]
        steps = [rng.sample(range(len(lengths)), rng.randrange(1, len(lengths) + 1))
                 for _ in range(rng.randrange(1, 5))]
        rows = [i for step in steps for i in step]  # each plain step's requests, in any order, some left out
        pool, reference_pool = PagePool(200, 4), PagePool(200, 4)
        tables, reference = tables_at(lengths, pool), tables_at(lengths, reference_pool)
        drafter = StagedPlaces()
        assert DFlashDrafter._stage_held(drafter, [tables[i] for i in rows]) == len(rows)
        positions = [reference[i].append()[0] for i in rows]
        # the pages a row's table holds at its position (which free pages a table takes does not matter)
        pages = [int(tables[i].array[p // 4]) for i, p in zip(rows, positions)]
        assert drafter.places == [positions, pages, [p % 4 for p in positions]]
        assert [t.length for t in tables] == [t.length for t in reference]
        assert [t.num_pages for t in tables] == [t.num_pages for t in reference]
        assert pool.num_free == reference_pool.num_free


def test_rows_of_plain_steps_of_the_same_requests_take_the_places_of_appending_them_row_by_row():
    """`_stage_repeated`: the same requests in the same order at every held step (the usual case under load)."""
    rng = random.Random(1)
    for _ in range(50):
        lengths = [rng.randrange(0, 13) for _ in range(rng.randrange(1, 7))]
        order = rng.sample(range(len(lengths)), len(lengths))
        steps = rng.randrange(1, 9)
        pool, reference_pool = PagePool(200, 4), PagePool(200, 4)
        tables, reference = tables_at(lengths, pool), tables_at(lengths, reference_pool)
        drafter = StagedPlaces()
        assert DFlashDrafter._stage_repeated(drafter, [tables[i] for i in order], steps) == steps * len(order)
        rows = order * steps
        positions = [reference[i].append()[0] for i in rows]
        pages = [int(tables[i].array[p // 4]) for i, p in zip(rows, positions)]
        assert drafter.places == [positions, pages, [p % 4 for p in positions]]
        assert [t.length for t in tables] == [t.length for t in reference]
        assert pool.num_free == reference_pool.num_free

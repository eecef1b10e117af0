"""Picking prompts from templates: every template's candidates in a seeded order, taken round-robin
over templates so that any number of prompts spreads evenly over the kinds of request, without
exact duplicates. (Near-duplicate filtering belongs to what fills the templates: two texts of one
template share most of their words by design.)"""

from __future__ import annotations

import random
from collections.abc import Sequence

from drafters.training.near_duplicates import unique_texts


def seeded_order(items: Sequence, seed: int, name: str) -> list:
    """`items` shuffled by a generator keyed by (seed, name): adding a template leaves the order of
    the others' candidates unchanged."""
    order = list(items)
    random.Random(f"{seed}:{name}").shuffle(order)
    return order


def round_robin(groups: Sequence[Sequence[str]]) -> list[str]:
    """The first candidate of every group, then the second of every group, ..."""
    depth = max((len(g) for g in groups), default=0)
    return [g[i] for i in range(depth) for g in groups if i < len(g)]


def pick_prompts(groups: Sequence[Sequence[str]], count: int | None) -> list[str]:
    """Up to `count` (None: all) prompts, distinct after normalization, taken round-robin over `groups`."""
    ordered = round_robin(groups)
    return [ordered[i] for i in unique_texts(ordered, threshold=None)][:count]

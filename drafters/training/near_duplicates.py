"""Duplicate filtering for prompt lists: exact after normalizing case and spacing, and near-duplicates
by word shingles.

Two texts are near-duplicates when the Jaccard similarity of their shingle sets (lower-cased words
and word pairs) reaches a threshold. The filter is greedy in list order: a text is dropped when it
is a duplicate of one already kept, so the first of a group survives and the result does not depend
on anything but the order. Pairwise overlaps come from one sparse matrix product per block of rows
(torch is the one array library every machine that builds prompts has).
"""

from __future__ import annotations

import re
import unicodedata
import warnings

import torch

WORD = re.compile(r"\w+")
BLOCK_ROWS = 1024  # rows of the [rows, n] overlap matrix materialized at once


def normalize(text: str) -> str:
    """The key of an exact duplicate: Unicode form, case and spacing made uniform. Punctuation stays:
    in math and code it is content (`2n - 1` is not `2n + 1`)."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def shingles(text: str) -> set[str]:
    """Lower-cased words and word pairs."""
    words = WORD.findall(normalize(text))
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}


def unique_texts(texts: list[str], threshold: float | None = 0.7) -> list[int]:
    """Indices of the texts kept, ascending: no two kept texts are equal after `normalize` or (unless
    threshold is None) have a shingle Jaccard similarity >= threshold."""
    first_of_key: dict[str, int] = {}
    order = [i for i, t in enumerate(texts) if first_of_key.setdefault(normalize(t), i) == i]
    if threshold is None:
        return order
    similar = _similar_earlier([shingles(texts[i]) for i in order], threshold)
    kept: list[int] = []
    kept_positions: set[int] = set()
    for position, index in enumerate(order):
        if not kept_positions.intersection(similar[position]):
            kept.append(index)
            kept_positions.add(position)
    return kept


def _similar_earlier(sets: list[set[str]], threshold: float) -> list[list[int]]:
    """For each set, the earlier sets whose Jaccard similarity with it is >= threshold."""
    n = len(sets)
    if n == 0:
        return []
    vocabulary: dict[str, int] = {}
    rows, cols = [], []
    for i, s in enumerate(sets):
        for shingle in s:
            rows.append(i)
            cols.append(vocabulary.setdefault(shingle, len(vocabulary)))
    incidence = torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.long).view(2, -1),
                                        torch.ones(len(rows)), (n, max(1, len(vocabulary))),
                                        check_invariants=False).coalesce()
    transposed = incidence.t().coalesce()
    sizes = torch.tensor([len(s) for s in sets], dtype=torch.float)
    similar: list[list[int]] = [[] for _ in range(n)]
    for start in range(0, n, BLOCK_ROWS):
        block = torch.arange(start, min(n, start + BLOCK_ROWS))
        with warnings.catch_warnings():  # sparse.mm goes through CSR internally, which warns "beta"
            warnings.simplefilter("ignore", UserWarning)
            overlap = torch.sparse.mm(incidence.index_select(0, block), transposed).to_dense()
        union = sizes[block, None] + sizes[None, :] - overlap
        jaccard = overlap / union.clamp(min=1)
        earlier = torch.arange(n)[None, :] < block[:, None]
        for row, col in torch.nonzero((jaccard >= threshold) & earlier).tolist():
            similar[start + row].append(col)
    return similar

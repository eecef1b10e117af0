"""A drafter's tokens ranked by how often the answers it learned from use them, most frequent first.

A draft step scores each draft position against the output layer's whole vocabulary: for the shipped drafter (two
layers, the target's 151,936-token output layer) that layer is ~87% of the weights a draft step reads. Drafts only
decide how much a step accepts, never what it commits, so a drafter may score just its most frequent tokens: a draft
the target would have made outside them is missed (that position is rejected), and everything committed is the
target's own choice as before. Frequency-ranked drafting (FR-Spec) and EAGLE-3's draft vocabulary do the same;
SGLang takes such a ranking as `--speculative-token-map`.

The ranking lives beside the drafter's weights (`RANKING_FILE`, int32 token ids, compressed: about half the bytes of
the plain array, which is also read, as `PLAIN_RANKING_FILE`); a drafter without one scores the whole vocabulary.
`rank_tokens` builds it from token sequences: the training answers (the best source: the drafter predicts exactly
those), or texts of the kind the target answers.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

RANKING_FILE = "token_ranking.npz"
PLAIN_RANKING_FILE = "token_ranking.npy"  # a ranking written as a plain array (as rankings once were)


def rank_tokens(sequences: Iterable[Sequence[int]], vocab_size: int, first: Sequence[int] = ()) -> np.ndarray:
    """The token ids that occur in `sequences`, most frequent first (ties: the lower id first); `first` (say, the end
    of turn tokens every answer ends with) lead, in their order."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in sequences:
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}): got {ids.min()}..{ids.max()}")
        counts += np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    seen = order[counts[order] > 0]
    leading = np.array(list(dict.fromkeys(int(t) for t in first)), dtype=np.int64)
    return np.concatenate([leading, seen[~np.isin(seen, leading)]]).astype(np.int32)


def write_token_ranking(directory: str | os.PathLike, ranking: np.ndarray) -> Path:
    path = Path(directory) / RANKING_FILE
    np.savez_compressed(path, ranking=np.asarray(ranking, dtype=np.int32))
    (Path(directory) / PLAIN_RANKING_FILE).unlink(missing_ok=True)  # one ranking a drafter: the new one
    return path


def _load_ranking(path: Path) -> np.ndarray:
    loaded = np.load(path, allow_pickle=False)
    if isinstance(loaded, np.ndarray):
        return loaded
    with loaded:
        return loaded["ranking"]


def read_token_ranking(directory: str | os.PathLike) -> np.ndarray | None:
    """The drafter's ranking (None: it has none and drafts over the whole vocabulary)."""
    path = next((p for p in (Path(directory) / f for f in (RANKING_FILE, PLAIN_RANKING_FILE)) if p.is_file()), None)
    if path is None:
        return None
    try:
        ranking = _load_ranking(path)
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as err:
        raise ValueError(f"cannot read the token ranking {path}: {err}; write it again with "
                         "scripts/rank_draft_tokens.py or remove it to draft over the whole vocabulary") from err
    if ranking.ndim != 1 or ranking.dtype.kind not in "iu" or len(np.unique(ranking)) != len(ranking):
        raise ValueError(f"the token ranking {path} must be a 1-d array of distinct token ids")
    return ranking.astype(np.int64)


def draft_vocabulary(ranking: np.ndarray | None, size: int, vocab_size: int) -> np.ndarray | None:
    """The ids a draft step scores, ascending: the `size` most frequent of `ranking`; None (the whole vocabulary) for
    size 0, without a ranking, or where they would be the whole vocabulary anyway."""
    if size < 0:
        raise ValueError(f"draft_vocab must be 0 (the whole vocabulary) or a positive number of tokens, got {size}")
    if ranking is None or size == 0 or size >= vocab_size:
        return None
    if len(ranking) and (ranking.min() < 0 or ranking.max() >= vocab_size):
        raise ValueError(f"the drafter's token ranking holds ids outside the target's vocabulary of {vocab_size}")
    return np.sort(ranking[:size])

"""Anchor sampling and the blocks, labels and loss weights built around each anchor.

An anchor t is a response position whose next position is also in the response
(loss_mask[t] and loss_mask[t + 1]). Its block is what the drafter sees at inference when t is
the last committed token:

    position   t        t+1   ...  t+bs-1
    input      ids[t]   MASK  ...  MASK
    label      -        ids[t+1]   ids[t+bs-1]     (ignored past the sequence or outside the loss mask)
    weight     0        1     ...  exp(-(bs-2)/gamma)

Weights decay with the block offset k as exp(-(k - 1) / gamma): early positions decide how many
drafts are accepted. A drafter trained for shorter blocks as well (`sample_block_sizes`) draws each
block's size: positions past it get no label and no weight, and its tokens see only the block's first
`size` (`mask.training_mask`), as a draft step of that block would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Anchors:
    positions: torch.Tensor  # int64 [B, A], ascending per row; padding rows hold 0
    valid: torch.Tensor  # bool [B, A]: False for padding when a sequence has fewer than A anchors
    block_sizes: torch.Tensor | None = None  # int64 [B, A]: each block's size (None: all whole)


def sample_block_sizes(anchors: Anchors, sizes: tuple[int, ...], generator: torch.Generator) -> Anchors:
    """The same anchors, each block's size drawn uniformly from `sizes` (CPU generator)."""
    choice = torch.randint(len(sizes), anchors.positions.shape, generator=generator)
    drawn = torch.tensor(sizes, dtype=torch.long)[choice].to(anchors.positions.device)
    return Anchors(anchors.positions, anchors.valid, drawn)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: positions t with loss_mask[t] and loss_mask[t + 1]."""
    cand = torch.zeros_like(loss_mask)
    cand[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return cand


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator) -> Anchors:
    """Up to max_anchors distinct candidates per sequence, uniformly at random (CPU generator)."""
    cand = anchor_candidates(loss_mask.cpu())
    count = int(cand.sum(1).max().clamp(min=1))
    a = min(max_anchors, count)
    keys = torch.rand(cand.shape, generator=generator)
    keys[~cand] = 2.0  # never picked before a real candidate
    picked_keys, picked = keys.topk(a, dim=1, largest=False)
    valid = picked_keys < 1.0
    positions = torch.where(valid, picked, torch.full_like(picked, cand.shape[1]))  # padding sorts last
    positions, order = positions.sort(dim=1)
    valid = valid.gather(1, order)
    positions = torch.where(valid, positions, torch.zeros_like(positions))
    return Anchors(positions.to(loss_mask.device), valid.to(loss_mask.device))


def first_anchors(loss_mask: torch.Tensor, count: int) -> Anchors:
    """Every candidate among the first `count` of each sequence, in order: with a response's
    candidates contiguous, anchor i is response position i, as in decoding from the first token."""
    cand = anchor_candidates(loss_mask)
    rank = cand.long().cumsum(1) - 1  # the candidate's index within its row
    keep = cand & (rank < count)
    a = max(1, int(keep.sum(1).max()))
    order = torch.where(keep, rank, torch.full_like(rank, a + count))  # kept ones first, in position order
    picked_order, picked = order.topk(a, dim=1, largest=False)  # ascending: the kept ones in position order
    valid = picked_order < count
    return Anchors(torch.where(valid, picked, torch.zeros_like(picked)), valid)


def decoding_walk(acceptance: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """The acceptance lengths greedy decoding would see over one sequence's consecutive anchors
    (`acceptance[i]` at the i-th response position, from `first_anchors`): each block starts where the
    previous one's accepted drafts and bonus token end, i.e. right after a rejected draft."""
    steps, i, n = [], 0, int(valid.sum())
    lengths = acceptance.tolist()
    while i < n:
        steps.append(lengths[i])
        i += lengths[i]
    return steps


def block_positions(anchors: Anchors, block_size: int) -> torch.Tensor:
    """int64 [B, A, bs]: absolute positions anchor + k."""
    return anchors.positions[..., None] + torch.arange(block_size, device=anchors.positions.device)


def block_input_ids(input_ids: torch.Tensor, anchors: Anchors, block_size: int, mask_token_id: int) -> torch.Tensor:
    """int64 [B, A, bs]: [ids[anchor], MASK x (bs-1)]."""
    b, a = anchors.positions.shape
    block = torch.full((b, a, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    block[..., 0] = input_ids.gather(1, anchors.positions)
    return block


def offset_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """float [bs]: 0 at k = 0, exp(-(k - 1) / gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, block_size: int,
                 gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels int64 [B, A, bs] with IGNORE where there is no target, weights float [B, A, bs])."""
    width = input_ids.shape[1]
    pos = block_positions(anchors, block_size)
    inside = pos < width
    clamped = pos.clamp(max=width - 1)
    target = input_ids.gather(1, clamped.flatten(1)).view_as(pos)
    ok = inside & loss_mask.gather(1, clamped.flatten(1)).view_as(pos) & anchors.valid[..., None]
    ok[..., 0] = False
    if anchors.block_sizes is not None:
        ok &= torch.arange(block_size, device=pos.device) < anchors.block_sizes[..., None]
    labels = torch.where(ok, target, torch.full_like(target, IGNORE))
    weights = offset_weights(block_size, gamma, input_ids.device) * ok
    return labels, weights


def acceptance_lengths(correct: torch.Tensor) -> torch.Tensor:
    """correct bool [..., bs-1] (draft k == label k) -> 1 + length of the all-correct prefix (greedy tau)."""
    return 1 + correct.long().cumprod(-1).sum(-1)

"""The training attention mask: many blocks of one sequence in one attention call.

Keys are [context positions 0..L-1 ; block 0 tokens ; block 1 tokens ; ...]. The query at offset k
of block j (anchor a_j) sees

    context position p   iff p < a_j          (the features the drafter has when a_j is the last
                                               committed token; a_j's own features are not known yet)
    block token (i, k')  iff i == j           (its own block, non-causal, all bs tokens)
                         and k' < size_j      (with block sizes drawn per block: its first size_j tokens,
                                               a block of that size at inference)

which is exactly the inference situation of each block, so one forward trains A blocks at once.
No query row is empty: every query sees its own block.
"""

from __future__ import annotations

import torch


def training_mask(anchor_positions: torch.Tensor, context_len: int, block_size: int,
                  block_sizes: torch.Tensor | None = None) -> torch.Tensor:
    """anchor_positions int64 [B, A] (block_sizes int64 [B, A]: each block's size, None: all whole) ->
    bool [B, 1, A*bs, L + A*bs] (True = may attend). Queries past their block's size see what its tokens see
    (their loss weight is 0)."""
    b, a = anchor_positions.shape
    dev = anchor_positions.device
    q_block = torch.arange(a * block_size, device=dev) // block_size  # [Q]: which block a query is in
    q_anchor = anchor_positions[:, q_block]  # [B, Q]
    sees_context = torch.arange(context_len, device=dev)[None, None, :] < q_anchor[:, :, None]  # [B, Q, L]
    own_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    if block_sizes is not None:  # key offset k' inside its block's size
        offset = torch.arange(a * block_size, device=dev) % block_size
        own_block = own_block & (offset[None, :] < block_sizes[:, q_block])[:, None, :]
    return torch.cat([sees_context, own_block], dim=-1)[:, None]

"""What the target accepts of a drafted block: pure functions over tensors.

A block is [anchor, d_1 .. d_{bs-1}]; target row j (the target's distribution after block[:j+1])
yields `target_tokens[j]`: its argmax (greedy) or a sample from its filtered distribution.
- accepted a = the longest prefix with d_{j+1} == target_tokens[j];
- bonus = target_tokens[a], the target's own token after the accepted run;
- committed per step = a + 1 tokens (the a accepted drafts and the bonus); the bonus is the next anchor.
Sampling stays lossless because drafts are one-hot: every committed token is a draw of the target at
a prefix that is exactly the committed text (a draft is kept only when it equals that draw).
"""

from __future__ import annotations

import torch


def accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor,
           lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [B, bs-1], target_tokens [B, bs] -> (accepted [B], bonus [B]). `lengths` [B]: request i's target
    ran rows 0 .. lengths[i] - 1 alone (a budget step), so it accepts at most lengths[i] - 1 drafts (its bonus is
    the target's token at a row that ran)."""
    matches = draft_tokens == target_tokens[:, :-1]
    if lengths is not None:
        matches &= torch.arange(matches.shape[1], device=matches.device) < lengths[:, None] - 1
    matches = matches.to(torch.int32)
    accepted = matches.cumprod(dim=1).sum(dim=1)
    bonus = target_tokens.gather(1, accepted[:, None].long()).squeeze(1)
    return accepted, bonus


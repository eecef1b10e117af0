"""The target's log-probabilities of committed tokens (`SamplingParams.logprobs`), read from the logits of
the forward that chose each token: the verify forward's rows for speculative steps, the decode step's
for plain ones, the prefill's last row for a first token. A committed token of a speculative step is the
target's own token at that row (an accepted draft equals it), so the numbers are the ones plain decoding
gives. Computed on the device only when a request of the step asks, and read after the step's tokens.

    rows = LogprobRows.start(logits, tokens, requests, rows_per_request)   # None if nobody asks
    per_request = rows.read(committed)     # request i: one TokenLogprob per committed token (or None)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.transfer import upload
from specdec.models.logprobs import packed_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None only for a prompt's first token (echo): nothing precedes it
    top: tuple[tuple[int, float], ...] = ()  # the most likely tokens at the position and theirs, most likely first


def wants_logprobs(requests) -> bool:
    return any(r.params.logprobs is not None for r in requests)


class LogprobRows:
    def __init__(self, requests, first_rows: list[int], k: int, packed: torch.Tensor):
        self.requests, self.first_rows, self.k, self.packed = requests, first_rows, k, packed

    @classmethod
    def start(cls, logits: torch.Tensor, tokens: torch.Tensor, requests, rows_per_request: int) -> LogprobRows | None:
        """Queue the log-probabilities of the rows of every request that asks: request i's rows are
        i * rows_per_request .. + rows_per_request - 1 of `logits` [n, vocab] and `tokens` [n]."""
        asking = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not asking:
            return None
        k = max(requests[i].params.logprobs for i in asking)
        rows = (np.asarray(asking)[:, None] * rows_per_request + np.arange(rows_per_request)).reshape(-1)
        index = upload(rows.astype(np.int64), logits.device)
        firsts = {i: n * rows_per_request for n, i in enumerate(asking)}
        return cls(requests, [firsts.get(i, -1) for i in range(len(requests))], k,
                   packed_logprobs(logits[index], tokens.view(-1)[index], k))

    def read(self, committed: list[list[int]]) -> list[list[TokenLogprob] | None]:
        """For each request the TokenLogprobs of its committed tokens, its first rows (None for a request that
        did not ask); one host transfer."""
        host = self.packed.tolist()
        return [None if first < 0 else [unpack(row, self.k, r.params.logprobs, token)
                                         for row, token in zip(host[first:first + len(tokens)], tokens)]
                for r, first, tokens in zip(self.requests, self.first_rows, committed)]


def unpack(row: list[float], k: int, wanted: int, token: int) -> TokenLogprob:
    """A packed row (`packed_logprobs` with k alternatives) as a TokenLogprob of `wanted` alternatives."""
    return TokenLogprob(token, row[0], tuple((int(row[1 + k + j]), row[1 + j]) for j in range(wanted)))

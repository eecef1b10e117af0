"""Generation metrics, defined once and read by the CLI, the library results and the eval.

Vocabulary (speculative decoding):
- verify step: one target forward over a request's block [anchor, drafts...];
- accepted: drafts that matched the target; committed per step = accepted + 1 (the bonus/next token);
- acceptance length tau = tokens committed per verify step, bonus included (1..block_size).
Plain autoregressive decoding is the special case tau = 1.
TPOT = decode time / tokens generated after the first (prefill excluded).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)  # committed tokens per verify step
    verify_lengths: list[int] = field(default_factory=list)  # tokens verified per verify step (anchor included)
    block_size: int = 0  # 0 = no drafter
    preemptions: int = 0  # times the request gave its KV pages back and was recomputed later
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at admission (not prefilled)

    @property
    def verify_steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float | None:
        return statistics.fmean(self.acceptance_lengths) if self.acceptance_lengths else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float:
        if self.first_token_time is None or self.finish_time is None:
            return 0.0
        return self.finish_time - self.first_token_time

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first one."""
        return self.decode_time / (self.generated_tokens - 1) if self.generated_tokens > 1 else None

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens or 0,
            "generated_tokens": self.generated_tokens,
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "decode_time_s": self.decode_time,
            "verify_steps": self.verify_steps,
            "tau": self.tau,
        }


@dataclass
class Summary:
    requests: int
    generated_tokens: int
    wall_time: float
    tokens_per_s: float
    tpot_s: float | None  # mean over requests of per-request TPOT
    verify_steps: int
    tau_mean_of_requests: float | None  # mean of per-request means (the z-lab convention)
    tau_overall: float | None  # committed tokens / verify steps over all requests
    per_position_acceptance: list[float]  # P(draft k accepted | draft k verified), k = 1..block_size-1
    histogram: dict[int, int]  # acceptance length -> number of verify steps
    verified_per_step: float | None = None  # tokens verified per verify step (the block, unless verify="auto")

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def format(self) -> str:
        line = (f"{self.generated_tokens} tokens from {self.requests} request(s) in {self.wall_time:.2f} s: "
                f"{self.tokens_per_s:.1f} tok/s")
        if self.tpot_s is not None:
            line += f", TPOT {self.tpot_s * 1000:.2f} ms"
        if self.tau_mean_of_requests is not None:
            line += (f"\nacceptance length tau {self.tau_mean_of_requests:.2f} (per-request mean), "
                     f"{self.tau_overall:.2f} overall over {self.verify_steps} verify steps of "
                     f"{self.verified_per_step:.1f} tokens on average")
            rates = " ".join(f"{r:.2f}" for r in self.per_position_acceptance)
            line += f"\nper-position acceptance: {rates}"
            hist = " ".join(f"{k}:{v}" for k, v in sorted(self.histogram.items()))
            line += f"\nacceptance-length histogram: {hist}"
        return line


def summarize(stats: list[RequestStats], wall_time: float) -> Summary:
    generated = sum(s.generated_tokens for s in stats)
    tpots = [s.tpot for s in stats if s.tpot is not None]
    lengths = [n for s in stats for n in s.acceptance_lengths]
    taus = [s.tau for s in stats if s.tau is not None]
    block = max((s.block_size for s in stats), default=0)
    # (acceptance length n, tokens verified q) per step; q is the block unless a step verified fewer drafts
    steps = [(n, q) for s in stats for n, q in zip(s.acceptance_lengths, s.verify_lengths or [s.block_size] * len(
        s.acceptance_lengths))]
    # a step of acceptance length n accepted drafts 1..n-1: position k is accepted iff n > k, among the
    # steps that verified it (q > k)
    per_position = []
    for k in range(1, block):
        verified = [n for n, q in steps if q > k]
        per_position.append(sum(n > k for n in verified) / len(verified) if verified else 0.0)
    return Summary(
        requests=len(stats),
        generated_tokens=generated,
        wall_time=wall_time,
        tokens_per_s=generated / wall_time if wall_time > 0 else 0.0,
        tpot_s=statistics.fmean(tpots) if tpots else None,
        verify_steps=len(lengths),
        tau_mean_of_requests=statistics.fmean(taus) if taus else None,
        tau_overall=sum(lengths) / len(lengths) if lengths else None,
        per_position_acceptance=per_position,
        histogram=dict(Counter(lengths)),
        verified_per_step=statistics.fmean(q for _, q in steps) if steps else None,
    )

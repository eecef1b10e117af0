"""State of one generation request: tokens, pages, stop conditions, stats."""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field
from functools import cached_property

from attention.page_pool import PageTable
from specdec.engine.detokenizer import IncrementalDetokenizer
from specdec.engine.logprobs import TokenLogprob
from specdec.engine.metrics import RequestStats
from specdec.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Invariant while decoding: the target cache holds K/V of every token except the last one
    committed (`pending_token`), which the next forward feeds in at position `num_cached`.

    Before that the request is prefilling: its `prefill_len` tokens (the prompt; after a preemption,
    the prompt and all output but the pending token) go into the cache chunk by chunk.

    With overlapped steps (plain decoding) a request may have a token `in_flight`: sampled on the device
    by a step whose results the host has not read back yet. It counts as output already (the pending
    token is then that one, on the device); the host commits it one step later."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
    error: str | None = None
    # where the text ends (a character index) when a stop string matched: where the match starts, or with
    # include_stop_str_in_output where it ends
    stop_text_end: int | None = None
    # what ended the request with finish reason "stop", as vLLM's stop_reason: the stop string matched or the stop
    # token id (None: end of sequence, or a structured output complete)
    stop_reason: str | int | None = None
    target_pages: PageTable | None = None
    generator: random.Random | None = None  # the random stream of a sampling request (specdec.engine.sampler)
    stats: RequestStats = field(default_factory=RequestStats)
    # committed tokens -> text, only when something needs text as it is produced (stop strings,
    # streaming): `use_detokenizer`. Requests without either never touch a tokenizer.
    detokenizer: IncrementalDetokenizer | None = None
    stop_tail: str = field(default="", repr=False)  # the last (longest stop - 1) characters searched
    max_total_tokens: int | None = None  # the model's context: prompt + output never exceed it
    in_flight: int = 0  # overlapped steps: tokens sampled on the device, not yet committed (1 between steps)
    flight_row: int = -1  # where that token sits in its step's device tokens
    # one per output token when params.logprobs is set (None otherwise)
    output_logprobs: list[TokenLogprob] | None = None
    # with params.prompt_logprobs: one per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # another answer of the same prompt (n > 1): with a prefix cache, this one is admitted once the lead's
    # prefill is done, and shares its prompt pages instead of prefilling them too
    lead: Request | None = field(default=None, repr=False)
    # the prefix cache's entries for the request's first full pages (adopted or cached by it), in order
    prefix_chain: list = field(default_factory=list, repr=False)
    # with params.structured_output: its grammar's llguidance matcher, advanced by every committed token
    # (specdec/engine/grammar.py)
    matcher: object | None = field(default=None, repr=False)

    def __post_init__(self):
        self.stats.prompt_tokens = len(self.prompt_ids)
        self.stats.arrival_time = time.perf_counter()
        if self.params.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def pending_token(self) -> int:
        return self.output_ids[-1]

    @property
    def num_cached(self) -> int:
        return self.target_pages.length

    @property
    def prefill_len(self) -> int:
        """Tokens whose K/V the target cache must hold before the request decodes."""
        return len(self.prompt_ids) + max(len(self.output_ids) + self.in_flight - 1, 0)

    @property
    def decoding(self) -> bool:
        return (bool(self.output_ids) or self.in_flight) and self.target_pages.length == self.prefill_len

    @property
    def can_take_more(self) -> bool:
        """Whether one more token fits its length limits once the token in flight is counted (EOS and
        stop strings are only known when the tokens are)."""
        return not self.finished and self._room(len(self.output_ids) + self.in_flight) > 0

    def _room(self, generated: int) -> int:
        """Output tokens the length limits (max_new_tokens, the model's context) leave after `generated`."""
        room = self.params.max_new_tokens - generated
        if self.max_total_tokens is not None:
            room = min(room, self.max_total_tokens - len(self.prompt_ids) - generated)
        return room

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start .. end - 1 of prompt + output, without building the whole list."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0):end - n]

    @cached_property
    def ending_ids(self) -> frozenset[int]:
        """The token ids that end the answer (its tokens keep it, its text only with include_stop_str_in_output):
        end of sequence unless ignored, and the request's stop_token_ids."""
        ids = frozenset() if self.params.ignore_eos else self.eos_token_ids
        return ids | frozenset(self.params.stop_token_ids or ())

    @property
    def ended_by_token(self) -> bool:
        """Whether an ending id (end of sequence or a stop token id), its last output token, ended the request: the
        text leaves that token out unless include_stop_str_in_output. (Commits test ending ids before stop strings
        and grammars, so a request whose last token is one ended on it.)"""
        return self.finish_reason == "stop" and bool(self.output_ids) and self.output_ids[-1] in self.ending_ids

    def use_detokenizer(self, tokenizer) -> None:
        """Turn committed tokens into text as they come; stop matching and streaming share it."""
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.params.skip_special_tokens)

    def commit(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Append one generated token (and its log-probability, when the request asked for them); returns True
        when the request has just finished. With structured output, the grammar must take the token, and a
        grammar that is complete ends the request."""
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not follow the request's structured output: {self.matcher.get_error()}")
        self.output_ids.append(token)
        if self.output_logprobs is not None:
            if logprob is None or logprob.token != token:
                raise RuntimeError(f"request {self.request_id} asked for logprobs but token {token} came without its own")
            self.output_logprobs.append(logprob)
        new_text = self.detokenizer.push(token) if self.detokenizer is not None else ""
        self.stats.generated_tokens = len(self.output_ids)
        now = time.perf_counter()
        if self.stats.first_token_time is None:
            self.stats.first_token_time = now
        if token in self.ending_ids:
            self._end_by_token(token)
        elif self.params.stop and self._matches_stop(new_text):
            self.finish("stop")
        elif self.matcher is not None and self.matcher.is_stopped():  # nothing but the end can follow
            self.finish("stop")
        elif self._room(len(self.output_ids)) <= 0:
            self.finish("length")
        return self.finished

    def commit_many(self, tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> int:
        """Commit tokens in order until one finishes the request; returns how many were taken."""
        if self.matcher is None and self.output_logprobs is None and self.detokenizer is None and not self.params.stop:
            return self._commit_ids(tokens)
        for n, token in enumerate(tokens, start=1):
            if self.commit(token, logprobs[n - 1] if logprobs is not None else None):
                return n
        return len(tokens)

    def _commit_ids(self, tokens: list[int]) -> int:
        """`commit` of each token in turn, at once, for a request whose tokens need nothing but their ids (no
        grammar, logprobs, text or stop strings): the same tokens taken, the same finish. A speculative step
        commits several tokens of every running request, so this runs for most requests of every step."""
        if not tokens:
            return 0
        output, stats = self.output_ids, self.stats
        room = self._room(len(output))
        # commit() takes one token even past the limits, then finishes (most steps fit: no copy)
        taken = tokens if len(tokens) <= room else tokens[:max(room, 1)]
        reason = "length" if len(taken) >= room else None
        ending = self.ending_ids
        if ending and not ending.isdisjoint(taken):
            end = next(n for n, token in enumerate(taken, start=1) if token in ending)
            taken, reason = taken[:end], "stop"
        output.extend(taken)
        stats.generated_tokens = len(output)
        if stats.first_token_time is None:
            stats.first_token_time = time.perf_counter()
        if reason == "stop":
            self._end_by_token(taken[-1])
        elif reason is not None:
            self.finish(reason)
        return len(taken)

    def _end_by_token(self, token: int) -> None:
        """Finish on an ending id: the stop reason is a stop token id's, None for end of sequence (vLLM's)."""
        eos = not self.params.ignore_eos and token in self.eos_token_ids
        self.stop_reason = None if eos else token
        self.finish("stop")

    def _matches_stop(self, new_text: str) -> bool:
        """Search the new text and the last (longest stop - 1) characters before it: a new match must
        end in the new text, everything before was searched at earlier commits. Linear overall, and
        a stop inside one long token is found."""
        if self.detokenizer is None:  # fail loudly rather than never stop
            raise RuntimeError("a request with stop strings needs use_detokenizer(tokenizer) before its first commit")
        if not new_text:
            return False
        window = self.stop_tail + new_text
        hits = [(h, s) for h, s in ((window.find(s), s) for s in self.params.stop) if h >= 0]
        if hits:
            start, stop = min(hits, key=lambda hit: hit[0])  # the earliest match; at a tie, the first stop given
            end = start + len(stop) if self.params.include_stop_str_in_output else start
            self.stop_text_end = self.detokenizer.num_chars - len(window) + end
            self.stop_reason = stop
            return True
        keep = max(map(len, self.params.stop)) - 1
        self.stop_tail = window[max(0, len(window) - keep):] if keep else ""
        return False

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.stats.finish_time = time.perf_counter()

"""What a request may ask of one engine: the model's context, its vocabulary and the KV pool's size.

Plain numbers (picklable, no tensors), so that a server can check a request before it reaches the
engine, in the engine's process or another one: the checks and their messages exist once, here.
"""

from __future__ import annotations

from dataclasses import dataclass

from attention.page_pool import pages_for


@dataclass(frozen=True)
class RequestLimits:
    max_context: int  # prompt + output tokens
    vocab_size: int
    num_pages: int  # the target's KV pool
    page_size: int
    lookahead: int  # slots a decode step writes past the committed length (the drafter's block, or 1)

    def most_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        """The most tokens (prompt and output) a request can come to hold."""
        return min(prompt_len + max_new_tokens, self.max_context)

    def worst_case_pages(self, prompt_len: int, max_new_tokens: int) -> int:
        return pages_for(self.most_tokens(prompt_len, max_new_tokens) + self.lookahead, self.page_size)

    def max_new_tokens_that_fit(self, prompt_len: int) -> int:
        """The largest max_new_tokens a prompt of this length can be served with (context and pool)."""
        return max(0, min(self.max_context, self.num_pages * self.page_size - self.lookahead) - prompt_len)

    def outside_vocabulary(self, token_ids) -> list[int]:
        """The first few of `token_ids` that are no token of the model's (to name in an error)."""
        return [t for t in token_ids if not 0 <= t < self.vocab_size][:5]

    def why_not_tokens(self, token_ids) -> str | None:
        """Why `token_ids` are not all tokens of the model's (None if they are)."""
        bad = self.outside_vocabulary(token_ids)
        return f"token ids {bad} are outside the vocabulary (size {self.vocab_size})" if bad else None

    def why_invalid(self, prompt_ids: list[int], max_new_tokens: int, logit_bias: dict | None = None,
                    stop_token_ids: tuple[int, ...] | None = None) -> str | None:
        """Why a request can never be served (None if it can)."""
        n = len(prompt_ids)
        if n == 0:
            return "the prompt is empty"
        if n >= self.max_context:
            return f"the prompt has {n} tokens but the model's context is {self.max_context}; shorten the prompt"
        problem = self.why_not_tokens(prompt_ids)
        if problem is not None:
            return problem
        for name, ids in (("logit_bias", logit_bias), ("stop_token_ids", stop_token_ids)):
            outside = self.outside_vocabulary(ids or ())
            if outside:
                return f"{name} names token ids {outside} outside the vocabulary (size {self.vocab_size})"
        need = self.worst_case_pages(n, max_new_tokens)
        if need > self.num_pages:
            return (f"the request needs up to {need} KV pages (prompt {n} + max_new_tokens {max_new_tokens}) but the "
                    f"pool has {self.num_pages}; lower max_new_tokens (at most {self.max_new_tokens_that_fit(n)} "
                    f"fit) or give the KV cache more memory (num_kv_pages / gpu_memory_utilization)")
        return None

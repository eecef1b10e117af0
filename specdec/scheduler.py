"""Admission policy: which waiting requests join the running batch.

A request is admitted only when the pool can hold its worst case (prompt + max_new_tokens +
the speculative lookahead), so a running request never runs out of pages and nothing is
preempted. A request whose worst case exceeds the whole pool fails alone, up front.
"""

from __future__ import annotations

from collections import deque

from attention.page_pool import PagePool
from specdec.request import Request, Status


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_prefill_tokens: int, lookahead: int, max_context: int):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.lookahead = lookahead  # slots a step may write past the committed length
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved = 0  # pages promised to running requests

    def worst_case_pages(self, request: Request) -> int:
        tokens = min(len(request.prompt_ids) + request.params.max_new_tokens, self.max_context) + self.lookahead
        return self.pool.pages_for(tokens)

    def why_unservable(self, request: Request) -> str | None:
        need = self.worst_case_pages(request)
        if need > self.pool.num_pages:
            return (f"request {request.request_id} needs up to {need} KV pages (prompt {len(request.prompt_ids)} + "
                    f"max_new_tokens {request.params.max_new_tokens}) but the pool has {self.pool.num_pages}; "
                    f"lower max_new_tokens or give the KV cache more memory (num_kv_pages / gpu_memory_utilization)")
        return None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) < self.max_num_seqs:  # admitted ones are running already
            request = self.waiting[0]
            need = self.worst_case_pages(request)
            if self.reserved + need > self.pool.num_pages:
                break
            if admitted and tokens + len(request.prompt_ids) > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            self.reserved += need
            tokens += len(request.prompt_ids)
            request.status = Status.RUNNING
            self.running.append(request)  # running from the moment its pages are reserved
            admitted.append(request)
        return admitted

    def drop_finished_waiting(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.finished)

    def release(self, request: Request) -> None:
        self.reserved -= self.worst_case_pages(request)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

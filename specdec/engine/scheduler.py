"""Which requests run in the next step, and with how many tokens: admission, chunked prefill, preemption.

Pages are taken as requests grow, not reserved up front, so the pool holds as many real answers
as fit. Each step is planned oldest request first (first come, first served):

    decoding request    needs room for `lookahead` more slots (1 for plain decoding, the block for
                        speculation; a token tree's where the batch may verify trees, `room`); the step
                        writes them and rolls back the rejected ones
    prefilling request  gets a chunk of its prefill, at most `max_prefill_tokens` per step over all
                        requests, so a long prompt never stalls the decoding of the others
    waiting request     is admitted while the budget, `max_num_seqs` and the free pages allow; the
                        queue is first in, first out, so nothing is overtaken for ever. With a prefix
                        cache it starts with the cached full pages its prefill begins with (shared, not
                        recomputed) and prefills only the rest; its last prefill token always runs, for
                        the logits of its first token

When the pool cannot hold what a request needs, the newest running request is preempted: its pages
(target's now, the drafter's when the engine gets the plan) go back and it returns to the front of the queue, keeping its output; on
re-admission it prefills prompt + output again (recompute) and goes on from where it stopped. The
oldest request can always run (it may preempt every other one, and `RequestLimits.why_invalid` refuses
up front a request whose worst case exceeds the whole pool), so the engine never stalls.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from attention.page_pool import PagePool, pages_for
from attention.prefix_cache import PrefixCache
from specdec.engine.request import Request, Status

PROMPT_LOGPROBS_CHUNK = 512  # prompt rows per step of a request that wants their logprobs (logits of each row)


@dataclass
class StepPlan:
    decode: list[Request] = field(default_factory=list)  # each decodes one step (`lookahead` slots)
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens of its prefill this step)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # joined the running set in this step
    room: int = 1  # slots each decoding request may write past its committed length in this step (`Scheduler.room`)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_prefill_tokens: int, lookahead: int,
                 prefix_cache: PrefixCache | None = None, tree_room: tuple[int, range] = (0, range(0))):
        """tree_room: a token tree's slots (its nodes and anchor) and the running batch sizes at which a step may
        verify one (`room`)."""
        self.pool = pool
        self.prefix_cache = prefix_cache  # its first pool is `pool`
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.lookahead = lookahead  # slots a decode step may write past the committed length (a chain's)
        self.tree_slots, self.tree_batches = tree_room
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    # ---- the queue -----------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def find(self, request_id: int) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None

    def drop_finished_waiting(self) -> None:
        self.waiting = deque(r for r in self.waiting if not r.finished)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- planning ------------------------------------------------------------------------------
    def room(self, batch: int) -> int:
        """Slots each decoding request may write past its committed length in a step planned with `batch` requests
        running: a token tree's where a batch of that size may verify trees, else the lookahead. Reserving a tree's
        64 slots for every request at any batch held ~4 pages a request where a chain needs 1-2; under `auto` trees
        run only at small batches. The room must never grow with the batch (`tree_batches` from 0 up): what an
        admission reserves, at the batch before it, has to cover the step after it, or requests admitted beside a
        lone one are preempted at the next step when the two together need a tree's slots each, and admitted again,
        over and over. A step that decodes fewer requests than ran at planning may not verify a tree its room does
        not hold (`SpeculativeDecoding.room`)."""
        return max(self.lookahead, self.tree_slots) if batch in self.tree_batches else self.lookahead

    @property
    def can_admit(self) -> bool:
        """Whether a waiting request may join the next step: one waits and the batch has a free seat."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def schedule(self, admit: bool = True) -> StepPlan:
        """Plan the next step. Pages are not taken here (the forwards take them), but the plan fits the pool.
        admit=False: no waiting request joins a step that decodes some (they may join the next)."""
        plan = StepPlan(room=self.room(len(self.running)))
        room = plan.room
        planned = 0  # pages the planned work will take from the pool
        free = self.pool.num_free  # read once per step (it changes only when a preemption gives pages back)
        budget = self.max_prefill_tokens
        i = 0
        while i < len(self.running):
            request = self.running[i]
            # retired at the end of the step that finished it; a token in flight that will end it (its
            # length limit) gets no further step
            if request.finished or (request.in_flight and not request.can_take_more):
                i += 1
                continue
            decoding = request.decoding  # read once: a property over the request's lengths
            tokens = room if decoding else self._chunk(request, budget)
            if tokens == 0:  # a prefill that finds the step's budget spent waits for the next step
                i += 1
                continue
            need = self._growth(request, tokens)
            while need > free - planned and self.running[-1] is not request:
                self._preempt(self.running[-1], plan)
                free = self.pool.num_free
            if need > free - planned:
                if decoding:  # the newest request, and even alone it does not fit: let the others go on
                    self._preempt(request, plan)
                    free = self.pool.num_free
                    continue
                tokens = self._tokens_that_fit(request, free - planned)
                if tokens == 0:
                    i += 1
                    continue
                need = self._growth(request, tokens)
            planned += need
            if decoding:
                plan.decode.append(request)
            else:
                plan.prefill.append((request, tokens))
                budget -= tokens
            i += 1
        if admit or not plan.decode:
            self._admit(plan, planned, budget, room)
        return plan

    def _admit(self, plan: StepPlan, planned: int, budget: int, room: int) -> None:
        """Waiting requests join while their whole prefill (and one step after it) fits beside the plan."""
        while self.can_admit and budget > 0:
            request = self.waiting[0]
            if request.in_flight:  # preempted with a token on its way back: it recomputes once that has landed
                break
            if self._lead_prefilling(request):  # its prompt's pages are about to be cached: wait for them
                break
            hit = self._cached_prefix(request)
            # new pages, plus the cached ones nobody holds: adopting those takes them out of the free count
            whole = self.pool.pages_for(request.prefill_len + room) - len(hit)
            if whole + (self.prefix_cache.evictable_among(hit) if hit else 0) > self.pool.num_free - planned:
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            plan.admitted.append(request)
            request.lead = None  # waited for it once; a later recompute shares what is cached by then
            if self.prefix_cache is not None:
                self._adopt(request, hit)
            tokens = self._chunk(request, budget)
            plan.prefill.append((request, tokens))
            planned += whole  # held back from later admissions in this step, though only a chunk runs now
            budget -= tokens

    @staticmethod
    def _chunk(request: Request, budget: int) -> int:
        """The prefill tokens a request runs this step: the rest of its prefill within the budget; a request
        that wants its prompt's logprobs takes at most PROMPT_LOGPROBS_CHUNK (each of its rows' logits)."""
        tokens = min(request.prefill_len - request.num_cached, budget)
        return min(tokens, PROMPT_LOGPROBS_CHUNK) if request.params.prompt_logprobs is not None else tokens

    def _lead_prefilling(self, request: Request) -> bool:
        """Whether the request's lead (another answer of its prompt) is still prefilling what it would share."""
        lead = request.lead
        return (self.prefix_cache is not None and lead is not None and lead.status is Status.RUNNING
                and not lead.output_ids and not lead.finished)

    def _cached_prefix(self, request: Request) -> list:
        """The cached full pages the request's prefill starts with, short of its last token."""
        if self.prefix_cache is None or request.params.prompt_logprobs is not None:  # every prompt row must run
            return []
        return self.prefix_cache.match(request.token_slice(0, request.prefill_len - 1))

    def _adopt(self, request: Request, hit: list) -> None:
        cache = self.prefix_cache
        request.prefix_chain = list(hit)
        request.target_pages.adopt(cache.pool_pages(hit, 0), len(hit) * cache.page_size)
        if request.stats.cached_tokens is None:  # counted at a request's first admission, not after preemptions
            request.stats.cached_tokens = request.num_cached
            cache.hit_tokens += request.num_cached

    def _growth(self, request: Request, tokens: int) -> int:
        """New pages `request` needs to hold `tokens` more slots."""
        table = request.target_pages
        return pages_for(table.length + tokens, self.pool.page_size) - table.num_pages

    def _tokens_that_fit(self, request: Request, free_pages: int) -> int:
        table = request.target_pages
        return max(0, (table.num_pages + free_pages) * self.pool.page_size - table.length)

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        self.running.remove(request)
        request.target_pages.free()  # the engine releases the drafter's pages when it gets the plan
        request.prefix_chain = []
        request.status = Status.WAITING
        request.stats.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)  # preempted newest first: the older ones end up in front
        plan.preempted.append(request)

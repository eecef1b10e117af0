"""The speculative decode phase: draft, verify, accept, roll back, for the whole running batch.

    q       = policy.choose(B)                        # verify the anchor and the first q-1 drafts (q <= bs),
                                                      # or a token tree (tree_speculator.py)
    drafts  = drafter.propose(batch, q - 1)           # [B, q-1], one drafter forward (the whole block runs,
                                                      # only the drafts to verify are scored)
    verify  = target([anchor, drafts[:q-1]...])       # one causal forward, q queries each (CUDA graphs)
    a, bonus = accept(drafts[:q-1], target tokens)    # greedy argmax or the target's samples
    tokens  = drafts[:a] + [bonus]; target cache -> start + a + 1 (whole pages past one more block back to the pool);
    the drafter's context grows by the features of positions start .. start + a.

One device-to-host transfer per step (the target's tokens and a together: the accepted drafts are the target's
own tokens); a step with a grammar (structured output) adds one, of the drafts, which its masks walk on the host
while the verify runs. With `draft_ahead`
the next step's draft is queued right after the transfer (from the acceptance on the device, see
`Drafter.propose_next`), so the GPU drafts while the host reads and commits; its length is the policy's choice
for the next step's batch then, and that step verifies no more drafts than it holds. With `verify_ahead` (a lone
request) or `verify_ahead_batches` (a batch whose graph rung keeps each request's KV in one piece) a chain step also
queues the next step's verify right after that draft (`_queue_next_verify`, planned for the latest starts it may
have, the real ones written on the device), which that step then takes instead of planning its verify once the host
has read this step's tokens; a step whose prompt chunks complete their prompts queues it too, the new requests' rows
after the others'. The engine commits the tokens;
one it cuts short (EOS, a stop, max_new_tokens) finishes the request, which then gives back its
target pages and drafter state, so the rollback and the drafter's context need not wait for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from attention.page_pool import PageTable
from attention.transfer import HostCopy, upload
from specdec.engine.acceptance import accept
from specdec.engine.decoding import Launched, PlainDecoding, StepTransfer
from specdec.engine.drafter import Drafter
from specdec.engine.logprobs import LogprobRows, TokenLogprob, wants_logprobs
from specdec.engine.request import Request
from specdec.engine.sampler import sample_block
from specdec.engine.tree_speculator import TreeDecoding
from specdec.engine.verify_policy import PLAIN, TREE, Budget, VerifyPolicy
from specdec.runtime.target_runner import BlockOutput, Carried, PrefillChunks, TargetRunner


class SpeculativeDecoding:
    def __init__(self, runner: TargetRunner, drafter: Drafter, policy: VerifyPolicy | None = None,
                 tree: TreeDecoding | None = None, draft_ahead: bool = True):
        self.runner = runner
        self.drafter = drafter
        # queue each chain step's next draft before reading its tokens (not with trees only: they draft candidates)
        self.draft_ahead = draft_ahead
        self.tokens_per_step = drafter.block_size  # the most a step commits per request
        self.policy = policy or VerifyPolicy(drafter.block_size, (drafter.block_size,))
        if self.policy.tree and tree is None:
            raise ValueError("a verify policy with trees needs the tree step")
        self.tree = tree
        self.plain = PlainDecoding(runner)  # the steps the policy runs without a draft (PLAIN)
        self.verify_length = drafter.block_size  # tokens per request the last step verified (a budget step: per)
        self.request_lengths: list[int] | None = None  # a budget step's, request by request (None: verify_length)
        self.option = drafter.block_size  # what the last speculative step verified: a chain length, TREE or a Budget
        # slots the next step's plan holds for each request past its committed length (the engine's, from the
        # scheduler; None: as many as any step writes): a tree step that would write more verifies a chain instead
        self.room: int | None = None
        # the engine's, each step: no request can join (none waits, or the batch is full), so the next step runs
        # these requests unless one ends
        self.next_step_known = False
        self.ahead: VerifiedAhead | None = None  # the next step's verify, queued by this one (`_queue_next_verify`)
        self.logprobs: list[list[TokenLogprob] | None] | None = None  # the last step's, per request (None: none asked)

    def _prefilled(self, prefill: PrefillChunks | None) -> torch.Tensor | None:
        """After a forward that carried prompt chunks: the drafter's context grows by their features now (a draft
        queued ahead for the requests they complete reads it), and the first tokens of those requests are sampled
        (on the device; None when the chunks complete no prompt)."""
        if prefill is None:
            return None
        self.drafter.add_context(prefill.requests, prefill.out.features, prefill.lens)
        prefill.context_added = True
        return prefill.sample_first(prefill.out.logits) if prefill.sample_first is not None else None

    def capture(self) -> float:
        """CUDA graphs of the tree step's small pieces (none for chains: the runners hold theirs)."""
        return self.tree.capture() if self.tree is not None else 0.0

    @torch.no_grad()
    def step(self, running: list[Request], prefill: PrefillChunks | None = None) -> list[list[int]]:
        batch = len(running)
        self.logprobs = None
        verified, self.ahead = self.ahead, None  # a verify the last step queued for this one
        nodes = self.tree.nodes_for(batch) if self.tree is not None else 0
        # logprobs, penalties and grammars work on the rows of a chain's verify: a step with a request that asks for
        # one verifies a chain (of the length the policy picks). Asked only where the policy may pick a tree
        chains_only = ((self.policy.tree or self.policy.budgets)
                       and (wants_logprobs(running) or any(r.params.adjusts_logits for r in running)))
        no_room = self.room is not None and nodes + 1 > self.room  # for a tree: a chain's room was planned
        # a budget step carries no prompt chunks (its forward runs the block rows alone)
        q = self.policy.choose(batch, nodes, trees=not chains_only and not no_room, plain=False,
                               budgets=not chains_only and prefill is None)
        self.option, self.request_lengths = q, None
        if q == TREE:
            tokens = self.tree.step(running, prefill)
            self.verify_length = self.tree.verify_length
            self.policy.observe_tree([len(t) - 1 for t in tokens], nodes)
            # what the whole chain would have had accepted: its running acceptance stays current while trees run
            self.policy.observe(self.tree.chain_accepted, self.policy.block_size)
            return tokens
        budget = q if isinstance(q, Budget) else None
        q = budget.q if budget is not None else q
        queued = self.drafter.queued_length  # a draft queued ahead, chosen for the batch of its time
        if queued is not None and queued + 1 < q:  # the chain of what it holds
            budget, q = None, queued + 1
        # where each request's verify rows start, in blocks of q: its place in the batch, or in a verify queued ahead
        blocks = verified.blocks_of(running, prefill, budget) if verified is not None else None
        if blocks is None:
            verified, blocks = None, list(range(batch))
        else:  # its rows are verified already: the chain of all of them
            q = verified.q
        # what runs: its wall time is weighed against its cost
        self.option, self.verify_length = budget or q, budget.per if budget is not None else q
        tables = [r.target_pages for r in running]
        starts = [t.length for t in tables]
        drafts = self.drafter.propose(running, q - 1)[:, :q - 1]  # [B, q-1] on the device
        # grammars walk the drafts on the host: their copy is queued before the verify, which runs while the
        # masks are computed
        drafts_host = HostCopy(drafts) if any(r.matcher is not None for r in running) else None
        anchors = [r.pending_token for r in running]
        if verified is not None:
            for table in tables:  # the slots the verify queued ahead wrote
                table.grow(q)
            out = verified.output(blocks, running)
        elif budget is None:
            out = self.runner.run_block(tables, anchors, drafts, q, prefill)
        else:  # a request accepts drafts only as far as its rows ran
            out, lengths = self.runner.run_budget(tables, anchors, drafts, self.drafter.confidence, q, budget.per,
                                                  logits=not all(r.params.greedy for r in running))
        first_tokens = self._prefilled(prefill)
        targets = sample_block(out, running, q, drafts, drafts_host).view(batch, q)
        accepted, bonus = accept(drafts, targets, lengths if budget is not None else None)
        rows = LogprobRows.start(out.logits, targets.view(-1), running, q)  # committed token j: the target's at row j
        # the accepted drafts equal the target's tokens at their rows, and the bonus is its token after them: a
        # request commits the first a + 1 of its target tokens, so those and a are all the host reads (and a budget
        # step's lengths)
        read = [targets, accepted[:, None].long()] + ([lengths[:, None]] if budget is not None else [])
        transfer = StepTransfer(torch.cat(read, dim=1), prefill, first_tokens)
        starting = prefill.starting if first_tokens is not None else []
        drafting = running + starting
        feature_rows = [block * q for block in blocks]
        # the next step's anchors: the bonus of each verified request, then the first token of each prompt completed
        anchors = torch.cat([bonus.long(), first_tokens.long()]) if starting else bonus
        ahead = self._queue_next_draft(running, starting, anchors, accepted, q, feature_rows)
        # after prompt chunks, only where each completes its prompt: the next step then runs these requests and those
        # (a prompt's start its prompt's end)
        prompts_done = prefill is None or len(starting) == len(prefill.requests)
        if ahead and budget is None and rows is None and drafts_host is None and prompts_done:
            taken = accepted
            if starting:  # a prompt's verify starts where its table ends: as if every draft of q had been accepted
                taken = torch.cat([accepted.long(), accepted.new_full((len(starting),), q - 1).long()])
            self.ahead = self._queue_next_verify(drafting, anchors, taken, q)
        host = transfer.read()
        tokens, counts = [], []
        room = self.tokens_per_step
        if self.ahead is not None:  # the verify queued ahead grew the new prompts' tables too: back to their prompts
            for request in starting:
                request.target_pages.truncate(request.prefill_len, room=room)
        for row, table, start in zip(host, tables, starts):
            count = row[q] + 1
            tokens.append(row[:count])
            counts.append(count)
            # keep K/V of the anchor and the accepted drafts; the bonus is the new pending token. The pages of the
            # next step's block stay with the request (it writes there again)
            table.truncate(start + count, room=room)
        if rows is not None:
            self.logprobs = rows.read(tokens)
        if budget is not None:
            self.request_lengths = [int(row[q + 1]) for row in host]
            self.policy.observe_budget(np.subtract(counts, 1).tolist(), budget)
        else:
            self.policy.observe(np.subtract(counts, 1), q)
        if ahead:
            self.drafter.settle(drafting, counts + [0] * len(starting))
        else:
            self.drafter.extend(running, out.features, feature_rows, counts)
        return tokens

    def _queue_next_draft(self, running: list[Request], starting: list[Request], anchors: torch.Tensor,
                          accepted: torch.Tensor, q: int, feature_rows: list[int]) -> bool:
        """The next step's draft, queued before this step's tokens reach the host (`Drafter.propose_next`): for the
        verified requests (anchor: the bonus; a + 1 context rows from `feature_rows` of the verify's features) and those
        whose prompts this step completed (anchor: the first token; no rows, their chunks' context is added), their
        anchors in that order. Not with trees only (a tree step drafts its own candidates). True when queued."""
        if not (self.draft_ahead and self.policy.lengths):
            return False
        option = self.policy.choose(len(running) + len(starting), trees=False)  # the next step's, as now seen
        length = (option.q if isinstance(option, Budget) else option) - 1
        if length == 0:  # a plain step: nothing to draft
            return False
        counts = accepted + 1
        if starting:
            counts = torch.cat([counts.long(), counts.new_zeros(len(starting), dtype=torch.long)])
        batch = len(running)
        return self.drafter.propose_next(running + starting, anchors, counts, feature_rows + [0] * len(starting),
                                         [q] * batch + [0] * len(starting), length)

    def _queue_next_verify(self, running: list[Request], anchors: torch.Tensor, accepted: torch.Tensor,
                           q: int) -> "VerifiedAhead | None":
        """The next step's verify of `running` (with the requests whose prompts this step completed, their anchors
        their first tokens), queued right after its draft and before this step's tokens reach the host
        (`TargetRunner.run_block_ahead`): the host then plans it while the GPU verifies this step, and the GPU goes
        from the draft to the verify while the host commits. Only where the next step is known to run these requests
        (none can join), with nothing they must follow on the host (penalties); None where not queued. A step after
        which some of them ended takes it without their rows (`VerifiedAhead.blocks_of`)."""
        if (not self.runner.queues_verify_ahead(len(running)) or not self.next_step_known
                or any(r.params.adjusts_logits for r in running)):
            return None
        drafts = self.drafter.drafts_ahead(running)
        if drafts is None:
            return None
        length, tables = drafts.shape[1] + 1, [r.target_pages for r in running]
        out = self.runner.run_block_ahead(tables, length, anchors, drafts, accepted, q)
        return VerifiedAhead(running, tables, length, out) if out is not None else None

    def plain_pays(self, batch: int) -> bool:
        """Whether the policy runs a step of `batch` requests as a plain decoding step (PLAIN): no draft pays at this
        batch. The caller rules out requests whose tokens the host must follow one by one (penalties, grammars)."""
        return PLAIN in self.policy.lengths and self.policy.choose(batch, trees=False) == PLAIN

    @torch.no_grad()
    def launch(self, running: list[Request], prefill: PrefillChunks | None, carried: Carried | None,
               starting: list[Request] = ()) -> Launched:
        """A plain decoding step (`plain_pays`), queued without waiting for its tokens as plain decoding's overlapped
        steps are (specdec/engine/flight.py). The drafter's context grows by the positions its forward computes (the
        running requests' inputs and the prompt chunks), so a later speculative step drafts from where they are."""
        self.drafter.catch_up(running)
        self.ahead = None  # a verify queued for a speculative step: this step comes instead
        self.verify_length = PLAIN
        return self.plain.launch(running, prefill, carried, starting, after_forward=self._plain_context)

    def _plain_context(self, running: list[Request], prefill: PrefillChunks | None) -> None:
        """After a plain step's forward: the context of its rows, the running requests' first (one each), then the
        chunks' (the forward's features in that order), in one call: the drafter may hold them all until its next
        draft and write them with other plain steps' rows (a chunk's written at once cost ~0.6 ms of host time a
        step at 256 requests). Chunks with no request decoding beside them are written now: such steps are rare
        under load, and the prefix cache takes a prompt's pages only once their context is written."""
        features = self.runner.features_out
        if prefill is not None:
            prefill.context_added = True
            if not running:
                self.drafter.add_context(prefill.requests, features[:sum(prefill.lens)], prefill.lens)
                return
            requests, lens = list(running) + prefill.requests, [1] * len(running) + prefill.lens
            self.drafter.add_step_context(requests, features[:sum(lens)], lens)
        elif running:
            self.drafter.add_step_context(running, features[:len(running)])


@dataclass
class VerifiedAhead:
    """A verify queued by the step before (`SpeculativeDecoding._queue_next_verify`): q rows of each of `requests`,
    after the tokens that step committed, their outputs in `out`."""

    requests: list[Request]
    tables: list[PageTable]
    q: int
    out: BlockOutput

    def blocks_of(self, running: list[Request], prefill: PrefillChunks | None, budget: Budget | None
                  ) -> list[int] | None:
        """Where this step finds each request's rows (block i: rows i * q ..), if it is the step the verify was queued
        for: a chain step of the same requests in the same order (their same tables), less any that ended or left
        meanwhile (their rows are not read), with no prompt chunks. None where it is not."""
        if prefill is not None or budget is not None or len(running) > len(self.requests):
            return None
        blocks, block = [], 0
        for request in running:
            while block < len(self.requests) and self.requests[block] is not request:
                block += 1
            if block == len(self.requests) or request.target_pages is not self.tables[block] or request.finished:
                return None
            blocks.append(block)
            block += 1
        return blocks

    def output(self, blocks: list[int], running: list[Request]) -> BlockOutput:
        """The rows of `running` (`blocks_of`), request by request: the outputs as they are where none ended, else
        their tokens (and logits, where a request samples) gathered; the features stay in place (read by block)."""
        if blocks == list(range(len(self.requests))):
            return self.out
        q, device = self.q, self.out.greedy.device
        rows = upload((np.asarray(blocks)[:, None] * q + np.arange(q)).reshape(-1).astype(np.int64), device)
        sampled = not all(r.params.greedy for r in running)
        return BlockOutput(self.out.logits[rows] if sampled else self.out.logits, self.out.greedy[rows],
                           self.out.features)

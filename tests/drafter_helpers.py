"""Random DFlash drafters in the z-lab format (small, for tests), and test drafters with known behaviour."""

from __future__ import annotations

from dataclasses import replace

import torch

from drafters.training.drafter_config import DrafterShape, save_random_drafter
from specdec.engine.drafter import Drafter

# what a test drafter is unless a test says otherwise
SHAPE = DrafterShape(num_layers=2, heads=4, kv_heads=2, head_dim=16, intermediate_size=96, block_size=4)


def build_random_drafter(path, target_config, seed=0, dtype=torch.float32, std=0.2, mask_token_id=None, **shape):
    """`save_random_drafter` with SHAPE changed by `shape` (DrafterShape fields), large weights and
    perturbed norms: every weight moves the drafts, so a loader that drops one shows."""
    if shape.get("target_layer_ids") is not None:
        shape["target_layer_ids"] = tuple(shape["target_layer_ids"])
    return save_random_drafter(path, target_config, replace(SHAPE, **shape), mask_token_id, seed=seed, std=std,
                               norm_std=0.1, dtype=dtype)


def drafter_context(engine, request) -> list:
    """The drafter's context K/V of every position its cache holds for `request`, layer by layer."""
    table = engine.drafter.context_table(request)
    positions = torch.arange(table.length)
    pages = torch.as_tensor(table.array, dtype=torch.long)[positions // table.pool.page_size]
    offsets = positions % table.pool.page_size
    return [torch.cat(layer.read(pages, offsets, torch.float32)) for layer in engine.drafter.kv.layers]


def write_step_context_at_once(drafter) -> None:
    """Makes `drafter` write each step's context rows at once (the base class's `add_step_context`) instead of
    holding them: the reference a held drafter's context is compared with."""
    drafter.add_step_context = lambda requests, features, lens=None: Drafter.add_step_context(
        drafter, requests, features, lens)


class ScriptedDrafter(Drafter):
    """Proposes from a known continuation of each prompt: `script(request) -> list of tokens`.

    With the target's own greedy continuation every draft is accepted (tau = block_size); with
    `wrong=True` every draft differs from it (tau = 1)."""

    def __init__(self, continuations: dict[tuple, list[int]], block_size: int, vocab: int, wrong=False,
                 error_rate=0.0, seed=0):
        self.continuations = continuations
        self.block_size = block_size
        self.vocab = vocab
        self.wrong = wrong
        self.error_rate = error_rate  # each draft is independently corrupted with this probability
        self.rng = torch.Generator().manual_seed(seed)
        self.target_layer_ids = (0,)
        self.live: set[int] = set()

    def attach(self, engine):
        self.device = engine.device

    def add_context(self, requests, features, lens):
        self.live.update(r.request_id for r in requests)

    def extend(self, requests, features, rows, counts):
        assert all(r.request_id in self.live for r in requests)

    def release(self, request):
        self.live.discard(request.request_id)

    def propose(self, requests, length=None):
        return self._scripted(requests)[1]

    def _scripted(self, requests) -> tuple[torch.Tensor, torch.Tensor]:
        """The continuation's next block_size - 1 tokens, and the drafts: those, each corrupted (+1) with
        probability error_rate (always with wrong=True)."""
        truth, rows = [], []
        for r in requests:
            cont = self.continuations[tuple(r.prompt_ids)]
            n = len(r.output_ids)
            nxt = (cont[n:n + self.block_size - 1] + [3] * self.block_size)[:self.block_size - 1]
            corrupt = torch.rand(len(nxt), generator=self.rng) < self.error_rate
            truth.append(nxt)
            rows.append([(t + 1) % self.vocab if self.wrong or c else t for t, c in zip(nxt, corrupt.tolist())])
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(truth), as_tensor(rows)


class ScriptedTreeDrafter(ScriptedDrafter):
    """A ScriptedDrafter with candidates for token trees: at each position the (possibly corrupted) draft
    first, then the continuation's own token when the draft was corrupted (else draft + 1), then draft + 2,
    ...: a tree recovers what the chain loses at a corrupted position."""

    proposes_candidates = True

    def attach(self, context):
        super().attach(context)
        self.k = context.candidates

    def propose_candidates(self, requests):
        return scripted_candidates(*self._scripted(requests), self.k, self.vocab)


def scripted_candidates(truth: torch.Tensor, drafts: torch.Tensor, k: int, vocab: int):
    """(log-probabilities, tokens) [B, n, k] of each position's k candidates: the draft first, then the true token
    where the draft is wrong (else draft + 1), then draft + 2, ...; log-probabilities -0.5, -1.5, ..."""
    ranks = torch.arange(k, device=drafts.device)
    tokens = (drafts[..., None] + ranks) % vocab
    tokens[..., 1] = torch.where(truth != drafts, truth, tokens[..., 1])
    return (-0.5 - ranks.float()).expand(*tokens.shape).clone(), tokens

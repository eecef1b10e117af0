"""Engines over tiny test models."""

from __future__ import annotations

import random

import pytest
import torch

from drafters import load_drafter
from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from specdec.engine.verify_policy import PLAIN
from specdec.models.loader import LoadedTarget, load_causal_lm
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter, scripted_candidates


def tiny_target(path, eos=(2,)) -> LoadedTarget:
    return LoadedTarget(load_causal_lm(path, torch.device("cpu"), torch.float32), None, frozenset(eos), path)


def tiny_engine(path, drafter=None, eos=(2,), **config) -> Engine:
    config.setdefault("num_kv_pages", 256)
    config.setdefault("page_size", 4)
    return Engine(tiny_target(path, eos), EngineConfig(device="cpu", **config), drafter)


PROMPTS = [[5, 17, 33, 9, 11, 40], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72], [3]]
MANY_PROMPTS = PROMPTS + [[11, 12, 13, 14, 15], [20] * 17, [30, 31, 32, 33, 34, 35, 36, 37, 38], [50, 40]]


def spec_engine(path, drafter, eos=(), **config):
    config.setdefault("num_kv_pages", 512)
    config.setdefault("page_size", 4)
    # the pools of scheduling tests are sized for a chain's lookahead (a tree reserves tree_nodes + 1 slots);
    # tests of trees and auto ask for them
    config.setdefault("verify", "chain")
    return Engine(tiny_target(path, eos), EngineConfig(device="cpu", **config), drafter)


def dflash_drafter(path, tmp_path, block_size, seed=0, **shape):
    target = tiny_target(path)
    build_random_drafter(tmp_path / f"drafter-{block_size}-{seed}", target.model.config, seed=seed,
                         block_size=block_size, **shape)
    return load_drafter(tmp_path / f"drafter-{block_size}-{seed}", target.model)


def module_target(name: str, seed: int, kind: str = "qwen3"):
    """A module-scoped fixture (assign it to `target_dir`): a tiny target model saved once for the module's tests."""
    @pytest.fixture(scope="module")
    def target_dir(tmp_path_factory):
        path = tmp_path_factory.mktemp(name)
        build_tiny_model(kind, path, seed=seed)
        return path
    return target_dir


def dflash_engine(path, tmp_path, **config) -> Engine:
    """An engine over the tiny target at `path` with a random block-4 DFlash drafter (EOS 2 and 9): what the tests of
    drafting ahead and of plain steps run."""
    return spec_engine(path, dflash_drafter(path, tmp_path, 4, seed=2), eos=(2, 9), **config)


def follow_the_target(drafter, continuations: dict[tuple, list[int]], error_rate: float, seed: int = 0) -> None:
    """Make a DFlash drafter's steps draft what the target answers: each draft step runs whole (its context, its
    queued drafts, its pages), then its drafts become the tokens after each request's anchor in `continuations`
    (prompt ids -> the target's greedy continuation), each corrupted (+1) with probability `error_rate`; its
    candidates lead with the draft, then the continuation's token where the draft was corrupted. A random drafter
    accepts almost nothing, so without this the paths of deep acceptance (K/V kept and moved, context rows written
    for several positions) would go untested on the CPU. What the drafter itself predicts from its context is
    replaced, so the context's contents are not checked here (the conformance tests against z-lab's code do)."""
    rng = random.Random(seed)
    batches = []  # the requests of the draft step running now (its rows' order)
    for name in ("_step", "propose_next"):
        def remembering(requests, *args, _original=getattr(drafter, name), **kwargs):
            batches.append(list(requests))
            try:
                return _original(requests, *args, **kwargs)
            finally:
                batches.pop()
        setattr(drafter, name, remembering)
    body = drafter._draft_body

    def drafting(batch, candidates=False, length=None):
        logits = body(batch, candidates, length)
        vocab = drafter.context.lm_head.weight.shape[0]
        n = drafter.block_size - 1 if length is None else length
        truth, drafts = [], []
        for request, start in zip(batches[-1], drafter.inputs["starts"][:batch].tolist()):  # the anchor's position
            sequence = list(request.prompt_ids) + continuations[tuple(request.prompt_ids)]
            row = (sequence[start + 1:start + drafter.block_size] + [3] * drafter.block_size)[:drafter.block_size - 1]
            truth.append(row)
            drafts.append([(t + 1) % vocab if rng.random() < error_rate else t for t in row])
        truth, drafts = torch.tensor(truth), torch.tensor(drafts)
        drafter.drafts_out[:batch, :n] = drafts[:, :n]
        if drafter.confidence_out is not None:
            drafter.confidence_out[:batch, :n] = -0.1
        if candidates:
            k = drafter.candidates_out[1].shape[-1]
            for out, made in zip(drafter.candidates_out, scripted_candidates(truth, drafts, k, vocab)):
                out[:batch] = made
        return logits
    drafter._draft_body = drafting


def failing_at(after: int, error: BaseException):
    """A wrapper for functions (their calls counted together) that raises `error` at the `after`-th call."""
    calls = {"n": 0}

    def failing(fn):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == after:
                raise error
            return fn(*args, **kwargs)
        return wrapped
    return failing


def run_failing(engine, owner, name: str, after: int, prompts, params) -> bool:
    """Run `prompts` with `owner.name` raising KeyboardInterrupt at its `after`-th call: every request of the call
    ends, the scheduler is idle and no page leaks; `owner.name` is itself again afterwards. Returns whether the
    interrupt came (the run called it `after` times)."""
    original = getattr(owner, name)
    setattr(owner, name, failing_at(after, KeyboardInterrupt(name))(original))
    interrupted = False
    try:
        requests = [engine.make_request(p, params) for p in prompts]
        try:
            engine.run(requests)
        except KeyboardInterrupt:
            interrupted = True
            assert all(r.finished for r in requests)
    finally:
        setattr(owner, name, original)
    assert engine.scheduler.idle
    assert_no_leak(engine)
    return interrupted


def run_staggered(engine, prompts, params_list) -> list:
    """Requests join every other step (one step after each, a second after every other one) while the earlier
    ones decode, then the engine steps until all have ended; returns them."""
    requests = []
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        requests.append(engine.add_request(prompt, params))
        engine.step()
        if i % 2:
            engine.step()
    while engine.has_unfinished_requests:
        engine.step()
    return requests


def run_workload(engine, arrivals, aborts, max_steps: int = 600) -> list:
    """Step the engine until every arrival has come and no request is unfinished (at most `max_steps` steps).
    arrivals: (step, add): add() queues requests on the engine at that step and returns them; aborts: (index, step):
    the index-th request queued by then is aborted at that step. Mid-run no pool counts a page twice. Returns the
    requests in the order they were queued."""
    requests, arrived, step = [], 0, 0
    pools = [engine.pool] + ([engine.drafter.pool] if getattr(engine.drafter, "pool", None) is not None else [])
    while step < max_steps and (engine.has_unfinished_requests or arrived < len(arrivals)):
        for at, add in arrivals:
            if at == step:
                requests.extend(add())
                arrived += 1
        for index, at in aborts:
            if at == step and index < len(requests):
                engine.abort(requests[index].request_id)
        if engine.has_unfinished_requests:
            engine.step()
        for pool in pools:  # nothing lost, nothing counted twice
            assert pool.num_free + pool.num_referenced <= pool.num_pages
        step += 1
    assert not engine.has_unfinished_requests
    return requests


def params_for(i: int, temperature: float) -> SamplingParams:
    """Request i's: ending after 6 + 5i tokens (or at EOS), seeded by i."""
    return SamplingParams(max_new_tokens=6 + 5 * i, temperature=temperature, seed=i)


def lone_runs(engine, prompts, temperature: float) -> list:
    """Each prompt alone, one after another (`params_for`)."""
    return [engine.generate_ids([prompt], params_for(i, temperature))[0] for i, prompt in enumerate(prompts)]


def plain_answers(path, prompts) -> list:
    """Greedy plain decoding of each prompt alone on the tiny target at `path` (EOS 2 and 9, as `dflash_engine`'s)."""
    return lone_runs(spec_engine(path, None, eos=(2, 9)), prompts, 0.0)


def count_deferred_admissions(engine) -> list[bool]:
    """For each step: whether a request that could have joined it waited for the next (a verify queued ahead)."""
    deferred, schedule = [], engine.scheduler.schedule

    def recorded(admit=True):
        plan = schedule(admit)
        deferred.append(bool(plan.decode) and engine.scheduler.can_admit and not admit)
        return plan

    engine.scheduler.schedule = recorded
    return deferred


def assert_logprobs_close(got, want, atol=1e-4):
    """Two requests' output logprobs: the same tokens, their logprobs and the top alternatives' within atol."""
    assert [t.token for t in got] == [t.token for t in want]
    for a, b in zip(got, want):
        assert a.logprob == pytest.approx(b.logprob, abs=atol)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] or all(
            x == pytest.approx(y, abs=atol) for (_, x), (_, y) in zip(a.top, b.top))  # ties may swap places


def assert_no_leak(engine):
    """Every page of the target's and the drafter's pools is free or kept by the prefix cache, none is held."""
    drafter_pool = getattr(engine.drafter, "pool", None)
    for index, pool in enumerate([engine.pool] + ([drafter_pool] if drafter_pool is not None else [])):
        assert pool.num_free == pool.num_pages
        assert pool.num_referenced == 0, "a page is still held"
        assert_pages_accounted(pool, engine.prefix_cache, index)


def assert_pages_accounted(pool, cache, index: int) -> None:
    """Each page is exactly one of free, held (referenced) or cached and unheld."""
    free = list(pool._free)
    cached = cache.cached_pages(index) if cache is not None else set()
    held = {p for p in range(pool.num_pages) if pool.refs(p)}
    assert len(free) == len(set(free)), "a page is free twice"
    assert not set(free) & (cached | held), "a free page is also held or cached"
    assert len(free) + len(cached | held) == pool.num_pages, "a page was lost"


PLANTED = 300.0  # a k_proj bias this large in a few channels, as Qwen2's layer 0 has (~360)


def planted_model(tmp_path):
    """A tiny Qwen2 target whose layer 0 has a k_proj bias of PLANTED in one RoPE pair per KV head."""
    hf = build_tiny_model("qwen2", tmp_path, seed=3)
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    with torch.no_grad():
        bias = hf.model.layers[0].self_attn.k_proj.bias
        for head in range(hf.config.num_key_value_heads):
            bias[head * head_dim + 1], bias[head * head_dim + 1 + head_dim // 2] = PLANTED, -0.7 * PLANTED
    hf.save_pretrained(tmp_path)
    return tiny_target(tmp_path, ()).model


def first_draft_logits(engine, prompt, params, plain_at=()):
    """Run one request, its steps numbered from its prefill (0): plain steps at the numbers `plain_at`, chains
    otherwise. Returns the draft logits (eager, over the drafter's context then) of its first speculative step after
    the plain steps (or its first, without any), its tokens at that point, and how many plain steps found context
    rows a chain step had left pending (no draft was queued for them)."""
    state = {"step": 0, "plain": not plain_at, "seen": None, "in_step": False, "pending": 0}
    decoding, drafter = engine.decoding, engine.drafter

    def choose(batch, nodes=0, trees=True, plain=True, budgets=True):
        # inside a speculative step the policy is asked about the next one (whether to queue its draft)
        step = state["step"] + state["in_step"]
        return PLAIN if plain and step in plain_at else 4

    def speculative_step(*args, **kwargs):
        state["in_step"] = True
        try:
            return step(*args, **kwargs)
        finally:
            state["in_step"] = False

    def catch_up(requests):
        state["pending"] += bool(drafter.pending)  # rows a chain step left to the draft that is not coming
        catching_up(requests)

    propose, launch, step, catching_up = drafter.propose, decoding.launch, decoding.step, drafter.catch_up
    decoding.policy.choose, decoding.step, drafter.catch_up = choose, speculative_step, catch_up

    def recording(requests, length=None):
        if state["plain"] and state["seen"] is None:
            state["seen"] = (drafter.draft_logits(requests).clone(), list(requests[0].output_ids))
        return propose(requests, length)

    def launched(running, *args, **kwargs):
        state["plain"] = state["plain"] or bool(running)  # a plain step (not a step of prompt chunks alone)
        return launch(running, *args, **kwargs)

    drafter.propose, decoding.launch = recording, launched
    engine.add_request(prompt, params)
    while state["seen"] is None:
        engine.step()
        state["step"] += 1
    return (*state["seen"], state["pending"])


def budget_step_against_chain(engine, prompts: list[list[int]], q: int, per: int, seed: int = 0):
    """One budget step (q, per) of `prompts` (their K/V written first) against the chain step of q over the same
    tokens and context, each from the same state: (chain's logits, greedy and features, the budget step's, and each
    request's verified tokens). The drafts and their confidences are random; the tables are freed after."""
    from attention.page_pool import PageTable

    runner = engine.runner
    tables = [PageTable(engine.pool) for _ in prompts]
    ids = torch.tensor([t for p in prompts for t in p], device=runner.device)
    runner.forward(tables, ids, [len(p) for p in prompts], logits_rows=None)
    starts = [t.length for t in tables]
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    anchors = torch.randint(3, vocab, (len(prompts),), generator=g).tolist()
    drafts = torch.randint(3, vocab, (len(prompts), q - 1), generator=g).to(runner.device)
    confidence = (-3 * torch.rand(len(prompts), q - 1, generator=g)).to(runner.device)
    chain = runner.run_block(tables, anchors, drafts, q)
    chain = [x.clone() if x is not None else None for x in (chain.logits, chain.greedy, chain.features)]
    for buffer in (runner.logits_out, runner.greedy_out, runner.features_out):  # what the budget step writes shows
        if buffer is not None:
            buffer.zero_()
    for table, start in zip(tables, starts):
        table.truncate(start)
    out, lengths = runner.run_budget(tables, anchors, drafts, confidence, q, per, logits=True)
    budget = [x.clone() if x is not None else None for x in (out.logits, out.greedy, out.features)]
    lengths = lengths.tolist()
    for table in tables:
        table.free()
    return chain, budget, lengths

"""CUDA graphs on the GPU: replayed steps (fixed decode / verify / draft steps, and the piecewise graphs
of steps that mix prompt chunks with them) give the tokens of eager steps, and a step synchronizes the
host with the GPU exactly once.

A random-weight Qwen2-style model and a random DFlash drafter, built in the test (no downloads).
Graph replays pad a batch to the next ladder size and may plan attention differently from an eager
step of the same batch, so bf16 rounding can flip a near-tie; every divergence is checked to be one
(logit gap under the eager engine <= NEAR_TIE), and batch 1 (no padding) must match exactly.
"""

import gc
import json
import os
import warnings

import pytest
import torch

from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from specdec.models.loader import LoadedTarget, load_causal_lm
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter

VOCAB, BLOCK, NEW_TOKENS, NEAR_TIE = 512, 16, 40, 0.5
BATCHES = (1, 3, 17, 64, 100, 256)  # 100: between rungs 96 and 128; 256: the ladder's top
MODEL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    hf = build_tiny_model("qwen2", root / "target", **MODEL)
    build_random_drafter(root / "drafter", hf.config, block_size=BLOCK, num_layers=2, heads=4, kv_heads=2,
                         head_dim=64, intermediate_size=256, std=0.05, mask_token_id=VOCAB - 1)
    return root


def make_engine(root, drafter: bool, kv: str, eager: bool, **config) -> Engine:
    from drafters import load_drafter

    model = load_causal_lm(root / "target", torch.device("cuda"), torch.bfloat16)
    target = LoadedTarget(model, None, frozenset(), root / "target")
    draft = load_drafter(root / "drafter", model) if drafter else None
    # steps in order unless a test asks for overlap (test_overlapped_steps_equal_steps_in_order)
    config = {"num_kv_pages": 4096, "max_num_seqs": 256, "overlap_steps": False, **config}
    return Engine(target, EngineConfig(device="cuda", kv_cache_dtype=kv, attention_backend="flashinfer",
                                       enforce_eager=eager, **config), draft)


def prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(3, VOCAB - 2, (int(torch.randint(5, 120, (1,), generator=g)),), generator=g).tolist()
            for _ in range(batch)]


def divergences(eager: Engine, eager_out, graph_out) -> list[dict]:
    found = []
    for i, (a, b) in enumerate(zip(eager_out, graph_out)):
        if a.output_ids == b.output_ids:
            continue
        pos = next(p for p, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y)
        logits = eager.next_token_logits(a.prompt_ids + a.output_ids[:pos])
        gap = (logits[a.output_ids[pos]] - logits[b.output_ids[pos]]).item()
        found.append({"request": i, "position": pos, "logit_gap": gap})
    return found


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_graphs_equal_eager(model_dirs, drafter, kv):
    eager, graphs = make_engine(model_dirs, drafter, kv, True), make_engine(model_dirs, drafter, kv, False)
    assert eager.graph_capture_seconds is None and graphs.graph_capture_seconds is not None
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    report = {"drafter": drafter, "kv": kv, "capture_s": graphs.graph_capture_seconds,
              "graph_mib": graphs.graph_memory_bytes / 2**20, "batches": {}}
    for batch in BATCHES:
        ids = prompts(batch)
        want = eager.generate_ids(ids, params)
        got = graphs.generate_ids(ids, params)
        diverged = divergences(eager, want, got)
        report["batches"][batch] = {"divergences": diverged, "tau": [r.stats.tau for r in got][:4]}
        if batch == 1:
            assert not diverged, diverged
        assert all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged
        for engine in (eager, graphs):
            assert engine.pool.num_free == engine.pool.num_pages
            if drafter:
                assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages
    print(json.dumps(report))
    folder = os.environ.get("SPECDEC_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"graphs-{'dflash' if drafter else 'ar'}-{kv}.json"), "w") as f:
            json.dump(report, f, indent=1)


def test_fp8_with_kept_layers_graphs_equal_eager(model_dirs):
    """An FP8 cache with layer 0 kept in bf16 (two FlashInfer wrappers per step): graphs give the eager
    engine's tokens, near-ties aside."""
    config = dict(kv_cache_full_precision_layers="0")
    eager, graphs = (make_engine(model_dirs, True, "fp8", e, **config) for e in (True, False))
    assert graphs.full_precision_layers == (0,) and graphs.kv.layers[0].data.dtype == torch.bfloat16
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for batch in (1, 17, 100):
        ids = prompts(batch)
        want, got = eager.generate_ids(ids, params), graphs.generate_ids(ids, params)
        diverged = divergences(eager, want, got)
        assert not diverged if batch == 1 else all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_graphs_awaiting_calibrated_fp8_scales_are_captured_after_the_first_prefill(model_dirs, drafter):
    """With calibrate_fp8_scales the first prefill sets the FP8 scales the graphs bake in. With overlapped steps the
    first step queues that prefill without waiting for it, and the graphs are still captured after it: the scales
    are those an eager engine's first prefill sets, and the outputs the eager engine's, near-ties aside."""
    config = dict(calibrate_fp8_scales=True, overlap_steps=True)
    eager, graphs = (make_engine(model_dirs, drafter, "fp8", e, **config) for e in (True, False))
    assert graphs.graph_capture_seconds is None  # waiting for the first prefill
    ids, params = prompts(17), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    want, got = eager.generate_ids(ids, params), graphs.generate_ids(ids, params)
    assert graphs.graph_capture_seconds is not None

    def scales(engine: Engine) -> list[tuple[float, float]]:
        return [(layer.k_scale, layer.v_scale) for layer in engine.kv.layers]

    assert scales(graphs) == scales(eager) and any(scale != (1.0, 1.0) for scale in scales(eager))
    diverged = divergences(eager, want, got)
    assert all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged


def staggered(engine: Engine, ids: list[list[int]], params: SamplingParams, per_step: int):
    """Requests arrive `per_step` at a time, one wave per step, while the earlier ones decode."""
    requests = []
    for start in range(0, len(ids), per_step):
        requests += [engine.add_request(p, params) for p in ids[start:start + per_step]]
        engine.step()
    while engine.has_unfinished_requests:
        engine.step()
    return requests


def count_calls(obj, name: str) -> list:
    calls, real = [], getattr(obj, name)
    setattr(obj, name, lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1])
    return calls


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_mixed_step_graphs_equal_eager(model_dirs, drafter):
    """Arrivals ride along the decode / verify forward; replayed from the piecewise graphs, they give the
    eager engine's tokens (near-ties aside: padding the step's rows may round differently)."""
    eager, graphs = make_engine(model_dirs, drafter, "auto", True), make_engine(model_dirs, drafter, "auto", False)
    replays = count_calls(graphs.runner.token_graphs["mixed"], "replay")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    report = {"drafter": drafter, "capture_s": graphs.graph_capture_seconds, "batches": {}}
    for batch, per_step in ((4, 1), (24, 3), (96, 8)):
        ids = prompts(batch)
        before = len(replays)
        want, got = staggered(eager, ids, params, per_step), staggered(graphs, ids, params, per_step)
        diverged = divergences(eager, want, got)
        report["batches"][batch] = {"mixed_replays": len(replays) - before, "divergences": diverged}
        assert len(replays) > before  # the arrivals' steps ran from the piecewise graphs
        assert all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged
        for engine in (eager, graphs):
            assert engine.pool.num_free == engine.pool.num_pages
    print(json.dumps(report))


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_a_mixed_steps_output_layer_runs_at_its_batch_rungs_rows(model_dirs, drafter):
    """The output layer of a step with arrivals runs over the rows of the block step's graph rung for its batch (rung
    times the tokens per request), whose GEMM shape the capture met, never over a row count of its own (cuBLAS's
    kernel choice for a new count costs the host up to milliseconds); the step's tokens stay the eager engine's."""
    eager, graphs = make_engine(model_dirs, drafter, "auto", True), make_engine(model_dirs, drafter, "auto", False)
    runner, rows = graphs.runner, []
    logits = runner.model.logits

    def recorded(hidden, out=None):
        if out is not None:  # (the block rows' logits; the prompts' first tokens' come without `out`)
            rows.append(hidden.shape[0])
        return logits(hidden, out)

    runner.model.logits = recorded
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = prompts(21)
    want, got = staggered(eager, ids, params, 5), staggered(graphs, ids, params, 5)
    del runner.model.logits
    counts = {size * q for q, ladder in runner.ladders.items() if isinstance(q, int) for size in ladder.sizes}
    # (batches of 5, 10, 15 and 20 requests decode beside the arrivals: their own row counts, 5 or 15 times q, are not
    # rung counts)
    assert rows and all(n in counts for n in rows), (rows, sorted(counts))
    diverged = divergences(eager, want, got)
    assert all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_overlapped_steps_equal_steps_in_order(model_dirs, eager):
    """Plain decoding with the next step queued before this one's tokens are read back: the same tokens as
    steps run one after the other (the same batches, so the same kernels), staggered arrivals included,
    and at most one wait for the GPU per step."""
    ordered = make_engine(model_dirs, False, "auto", eager, overlap_steps=False)
    overlapped = make_engine(model_dirs, False, "auto", eager, overlap_steps=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for batch, per_step in ((1, 1), (5, 5), (24, 3)):
        ids = prompts(batch)
        want, got = staggered(ordered, ids, params, per_step), staggered(overlapped, ids, params, per_step)
        assert [r.output_ids for r in got] == [r.output_ids for r in want], batch
        assert overlapped.pool.num_free == overlapped.pool.num_pages and overlapped.flight is None
    assert len(waits_of_a_decoding_step(overlapped, params)) == 1
    assert overlapped.pool.num_free == overlapped.pool.num_pages


def ahead_against_in_order(ordered: Engine, ahead: Engine, params: SamplingParams, cases) -> list[tuple]:
    """For each (batch, arrivals per step) of `cases`, the same staggered requests through an engine drafting in
    order and one drafting ahead: batch 1 token for token, larger batches up to near-ties, both engines' pools
    (target and drafter) free afterwards. Returns each case's (in order, ahead) requests."""
    runs = []
    for batch, per_step in cases:
        ids = prompts(batch)
        want, got = staggered(ordered, ids, params, per_step), staggered(ahead, ids, params, per_step)
        if batch == 1:
            assert got[0].output_ids == want[0].output_ids
        found = divergences(ordered, want, got)
        assert all(abs(d["logit_gap"]) <= NEAR_TIE for d in found), found
        for engine in (ordered, ahead):
            assert engine.pool.num_free == engine.pool.num_pages
            assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages
        runs.append((want, got))
    return runs


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_drafting_ahead_equals_drafting_in_order(model_dirs, kv):
    """DFlash with each step's next draft queued before its tokens are read back (the draft's attention planned
    for the whole block accepted, its real lengths read on the device) commits what steps drafted in order
    commit: batch 1 token for token, larger batches with staggered arrivals up to near-ties (a draft flipped by
    the plan's different KV split changes the schedule, not a verified token); about the same acceptance; one
    wait for the GPU per step."""
    from specdec.engine.verify_policy import PLAIN

    ordered = make_engine(model_dirs, True, kv, False, overlap_steps=False)
    ahead = make_engine(model_dirs, True, kv, False, overlap_steps=True)
    policy = ahead.decoding.policy  # the same options as the engine in order: no plain steps (tested on their own)
    policy.lengths = tuple(q for q in policy.lengths if q != PLAIN)
    queued = count_calls(ahead.drafter, "settle")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    for want, got in ahead_against_in_order(ordered, ahead, params, ((1, 1), (5, 5), (24, 3))):
        tau = [sum(len(r.stats.acceptance_lengths) for r in rs) / sum(len(r.output_ids) for r in rs)
               for rs in (want, got)]
        assert abs(tau[0] - tau[1]) <= 0.05 * tau[0], tau
    assert len(queued) > NEW_TOKENS  # the drafts really were queued ahead
    assert len(waits_of_a_decoding_step(ahead, params)) == 1
    assert ahead.pool.num_free == ahead.pool.num_pages and ahead.drafter.pool.num_free == ahead.drafter.pool.num_pages


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_batches_verifies_queued_ahead_equal_verifies_in_order(model_dirs, kv, monkeypatch):
    """A batch's next verify queued with its draft (`verify_ahead_batches`): a rung that keeps each request's KV in one
    piece (49+ requests: rungs of 64 and up) is planned for every request's latest start, the real starts and page
    metadata made on the device, and it commits what verifies planned in order commit, with requests ending at
    different steps: up to near-ties, since a step after which some ended takes the rows of the others from the larger
    batch's verify where verifying in order runs a smaller batch, whose rung may split the KV (before any ended, at 64
    and 100 requests, token for token). Smaller batches' rungs split the KV and never queue one. Pools free after."""
    from specdec.engine import speculator

    ordered = make_engine(model_dirs, True, kv, False, overlap_steps=True, verify="chain", verify_ahead_batches="off")
    ahead = make_engine(model_dirs, True, kv, False, overlap_steps=True, verify="chain", verify_ahead_batches="on")
    taken, blocks_of = [], speculator.VerifiedAhead.blocks_of

    def recorded(self, *args):
        blocks = blocks_of(self, *args)
        if blocks is not None:
            taken.append(len(self.requests))
        return blocks

    monkeypatch.setattr(speculator.VerifiedAhead, "blocks_of", recorded)
    for batch in (17, 64, 100):
        ids = prompts(batch)
        runs = []
        for engine in (ordered, ahead):
            requests = [engine.add_request(p, SamplingParams(max_new_tokens=24 + i % 17, ignore_eos=True))
                        for i, p in enumerate(ids)]
            while engine.has_unfinished_requests:
                engine.step()
            runs.append(requests)
            assert engine.pool.num_free == engine.pool.num_pages
            assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages
        found = divergences(ordered, runs[0], runs[1])
        assert all(abs(d["logit_gap"]) <= NEAR_TIE for d in found), (batch, found)
        if batch == 17:
            assert not taken
    assert len(taken) > 10 and min(taken) > 48  # rung 64 (49-64 requests) and up keep the KV in one piece


def test_held_context_rows_of_plain_steps_draft_as_rows_written_at_once(model_dirs):
    """Plain steps' context rows, held and written together from the graphs of the held step before the next
    draft, give that draft the logits it gets when each plain step writes its row at once (the same target
    features; only the projection's rounding over 9 rows against 1 may differ)."""
    from drafters.dflash import HELD_STEP
    from tests.drafter_helpers import write_step_context_at_once
    from tests.engine_helpers import first_draft_logits

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = prompts(1)[0]
    held, at_once = (make_engine(model_dirs, True, "auto", False, overlap_steps=True, verify="auto") for _ in range(2))
    write_step_context_at_once(at_once.drafter)
    replays = count_calls(held.drafter.token_graphs[HELD_STEP], "replay")
    (want, want_tokens, _), (got, tokens, _) = (first_draft_logits(e, prompt, params, range(1, 10))
                                                for e in (at_once, held))
    assert tokens == want_tokens and len(replays) == 1
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()


def test_a_plain_step_writing_held_context_rows_and_a_prompts_context_never_waits_for_its_own_forward(
        model_dirs, monkeypatch):
    """A plain step whose held context rows fill up writes them, and its own rows, more than the held buffer takes
    with a prompt chunk riding along, are written next: two uploads of the drafter's context inputs in one step, the
    first queued behind the step's forward. The second fills the other pinned mirror: no fill waits for a copy still
    queued, and the prompt's answer is plain decoding's."""
    import drafters.dflash as dflash
    from attention.transfer import CopyFence
    from specdec.engine.verify_policy import PLAIN

    monkeypatch.setattr(dflash, "HELD_ROWS", 8)  # with 4 requests: the held rows fill up every other plain step
    engine = make_engine(model_dirs, True, "auto", False, overlap_steps=True, verify="auto", max_num_seqs=5)
    engine.decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: PLAIN if plain else 2
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    running = [engine.add_request(p, params) for p in prompts(4)]
    for _ in range(3):  # the prompts, then plain steps
        engine.step()
    drafter = engine.drafter
    while len(drafter.held_tables) + len(running) <= drafter.held_features.shape[0]:
        engine.step()  # until the next plain step writes the held rows
    blocked, wait = [], CopyFence.wait

    def recorded_wait(fence):  # a wait of the context inputs' fences for a copy the GPU has not run yet
        if fence in drafter.context_inputs.fences and fence._copied is not None and not fence._copied.query():
            blocked.append(fence)
        wait(fence)

    monkeypatch.setattr(CopyFence, "wait", recorded_wait)
    arrival = engine.add_request(prompts(5)[4], params)
    writes = count_calls(drafter, "_run_context")
    torch.cuda._sleep(200_000_000)  # the GPU busy (~0.1 s) with earlier work while the step is queued
    engine.step()
    assert len(writes) == 2  # the held rows, then the step's own (4 + the prompt's > 8), in one step
    assert not blocked
    monkeypatch.setattr(CopyFence, "wait", wait)
    while engine.has_unfinished_requests:
        engine.step()
    plain = make_engine(model_dirs, False, "auto", False)
    want = plain.generate_ids([arrival.prompt_ids], params)
    assert all(d["logit_gap"] <= NEAR_TIE for d in divergences(plain, want, [arrival]))
    assert engine.pool.num_free == engine.pool.num_pages
    assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages


def test_each_draft_lengths_graph_scores_the_eager_drafts(model_dirs):
    """verify="auto" captures a draft graph per chain length (only the drafts a step verifies are scored): each
    replayed at batch 1 and 5 gives the argmax of the eager step's logits at those positions (near-ties aside),
    over the same context."""
    from drafters.dflash import DRAFT_STEP

    engine = make_engine(model_dirs, True, "auto", False, verify="auto")
    drafter = engine.drafter
    assert drafter.draft_lengths == tuple(q - 1 for q in engine.decoding.policy.lengths)
    params = SamplingParams(max_new_tokens=10 * NEW_TOKENS, ignore_eos=True)  # none finishes in three steps
    for batch in (1, 5):
        requests = [engine.add_request(ids, params) for ids in prompts(batch)]
        for _ in range(3):  # the prompts, then two speculative steps: the drafter's context has verify rows
            engine.step()
        for n in drafter.draft_lengths:
            assert drafter.replays((DRAFT_STEP, n), batch)
            drafts = drafter.propose(requests, n)[:, :n].clone()
            logits = drafter.draft_logits(requests)[:, :n].float()  # eager, the whole block, the same context
            gap = logits.max(dim=-1).values - logits.gather(-1, drafts[..., None]).squeeze(-1)
            assert (gap <= NEAR_TIE).all(), (batch, n, gap.max().item())
        for request in requests:
            engine.abort(request.request_id)
        assert engine.pool.num_free == engine.pool.num_pages
        assert engine.drafter.pool.num_free == engine.drafter.pool.num_pages


def test_static_inputs_filled_again_while_their_last_upload_is_queued_neither_wait_nor_change_it():
    """A second upload in one step (a plain step's held drafter context, then its prompt chunks') finds the first
    copy queued behind the step's forward: the fill writes the other pinned mirror, without waiting for the GPU, and
    what the first copy sends is the first fill's values."""
    from specdec.runtime.cuda_graphs import StaticInputs

    inputs = StaticInputs({"a": 4, "b": 3}, torch.device("cuda"))
    inputs.fill("a", [1, 2, 3, 4])
    inputs.fill("b", [5, 6, 7])
    torch.cuda._sleep(200_000_000)  # the stream stays busy (~0.1 s): the copy below waits in the queue
    inputs.upload()
    sent_first = inputs.device_buffer.clone()  # queued after that copy: what it sent
    inputs.fill("a", [9, 9])  # "b" is not filled again: it keeps its values
    assert not torch.cuda.current_stream().query()  # the fill did not wait for the queued copy
    inputs.upload()
    torch.cuda.synchronize()
    assert sent_first.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert inputs.device_buffer.tolist() == [9, 9, 0, 0, 5, 6, 7]
    inputs.fill("b", [8])  # both copies have run: the mirror in use is written again
    inputs.upload()
    torch.cuda.synchronize()
    assert inputs.device_buffer.tolist() == [9, 9, 0, 0, 8, 0, 0]


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_graph_memory_is_counted_before_the_pool_is_sized(model_dirs, drafter):
    gc.collect()  # engines of earlier tests give their memory back first
    torch.cuda.empty_cache()
    engine = make_engine(model_dirs, drafter, "auto", False, num_kv_pages=None, gpu_memory_utilization=0.5)
    assert engine.runner.ladders[engine.decoding.tokens_per_step].sizes[-4:] == (160, 192, 224, 256)
    assert engine.graph_memory.pool > 0 and engine.graph_memory.slots > 0
    # capture took no more than what was held back for it
    assert engine.graph_memory_bytes <= engine.graph_reserve_bytes, (
        engine.graph_memory_bytes, engine.graph_reserve_bytes)
    free, total = torch.cuda.mem_get_info()
    assert free >= 0.5 * total  # weights, KV pool and graphs within gpu_memory_utilization
    print(json.dumps({"drafter": drafter, "graph_mib": engine.graph_memory_bytes / 2**20,
                      "reserved_mib": engine.graph_reserve_bytes / 2**20, "pages": engine.num_pages}))
    del engine
    gc.collect()


SAMPLING = {"greedy": {}, "sampled": dict(temperature=0.8, top_p=0.9, top_k=50)}


def synchronizations_in_one_step(engine: Engine, batch: int, sampling: dict) -> list[str]:
    """Admit and prefill a batch, run one warm-up step, then count the syncs of the next step."""
    admitted = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=i, **sampling))
                for i, p in enumerate(prompts(batch))]
    engine.step()  # prefill
    engine.step()  # warm-up decode step
    assert all(r.decoding for r in admitted)
    noop = lambda request, tokens: None  # noqa: E731
    syncs = synchronizing_calls(lambda: engine._decode(admitted, noop))
    for request in admitted:
        engine.abort(request.request_id)
    return syncs


def test_tree_steps_drafted_ahead_equal_tree_steps_drafted_in_order(model_dirs):
    """verify="tree" with each tree step's next draft with candidates queued before its tokens are read back
    (planned for the whole block accepted, the real lengths read on the device) commits what tree steps that
    draft for themselves commit: batch 1 token for token, larger batches with staggered arrivals up to near-ties;
    one wait for the GPU per step; no page leaked."""
    ordered = make_engine(model_dirs, True, "auto", False, verify="tree", tree_nodes=31, overlap_steps=False)
    ahead = make_engine(model_dirs, True, "auto", False, verify="tree", tree_nodes=31, overlap_steps=True)
    queued = count_calls(ahead.drafter, "settle")
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ahead_against_in_order(ordered, ahead, params, ((1, 1), (5, 5), (12, 3)))
    assert len(queued) > NEW_TOKENS  # the candidates really were queued ahead
    assert len(waits_of_a_decoding_step(ahead, params)) == 1


def waits_of_a_decoding_step(engine: Engine, params: SamplingParams) -> list[str]:
    """The waits for the GPU (`synchronizing_calls`) of one step of 5 requests decoding; then they are aborted."""
    requests = [engine.add_request(p, params) for p in prompts(5)]
    engine.step()
    engine.step()
    waits = synchronizing_calls(engine.step)
    for request in requests:
        engine.abort(request.request_id)
    while engine.has_unfinished_requests:
        engine.step()
    return waits


def synchronizing_calls(run) -> list[str]:
    """Where `run()` made the host wait for the GPU: as torch's sync debug mode reports it, and each wait for
    a `HostCopy` (an event's, which the debug mode does not report)."""
    from attention.transfer import HostCopy

    torch.cuda.synchronize()
    waits, read = [], HostCopy.tolist
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        HostCopy.tolist = lambda copy: (waits.append("HostCopy.tolist"), read(copy))[1]
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            HostCopy.tolist = read
    # the message of a sync; the one-time "debug mode is a prototype" notice is not one
    return [f"{w.filename}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)] + waits


def synchronizations_in_a_step_with_an_arrival(engine: Engine, batch: int, sampling: dict) -> list[str]:
    """A decoding batch, then a step in which a new request's whole prompt rides along."""
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed, **sampling)

    admitted = [engine.add_request(p, params(i)) for i, p in enumerate(prompts(batch))]
    engine.step()
    engine.step()
    arrival = engine.add_request(prompts(1)[0], params(batch))
    syncs = synchronizing_calls(engine.step)
    assert arrival.output_ids  # its prompt was prefilled in that step and its first token sampled
    for request in [*admitted, arrival]:
        engine.abort(request.request_id)
    return syncs


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_one_synchronization_per_step(model_dirs, drafter, eager, sampling):
    engine = make_engine(model_dirs, drafter, "auto", eager)
    for batch in (1, 5):
        syncs = synchronizations_in_one_step(engine, batch, SAMPLING[sampling])
        assert len(syncs) == 1, syncs
        syncs = synchronizations_in_a_step_with_an_arrival(engine, batch, SAMPLING[sampling])
        assert len(syncs) == 1, syncs
    assert engine.pool.num_free == engine.pool.num_pages


def force_trees_below(engine: Engine, batch: int) -> None:
    """verify="auto" with measured costs replaced: token trees for steps of fewer than `batch` requests,
    chains of the block above."""
    from specdec.engine.verify_policy import TREE, StepCosts

    policy = engine.decoding.policy
    rungs = policy.costs.verify[BLOCK]
    policy.costs = StepCosts({}, {q: {r: 1.0 if q == BLOCK else 1e3 for r in rungs} for q in policy.lengths}
                             | {TREE: {r: 1e-3 if r < batch else 1e3 for r in rungs}})


def test_tree_steps_graphs_equal_eager(model_dirs):
    """Token trees on FlashInfer (fa2 with the trees' custom mask), their building and acceptance replayed
    from graphs per rung and the verify from the mixed step's piecewise graphs past the tree graphs' largest
    rung, give the eager engine's tokens (near-ties aside) at every batch with verify="tree"; verify="auto"
    measures a tree's cost at every rung after capture, verifies trees only where the running batch may hold a
    tree's KV slots (up to TREE_GRAPH_MAX_BATCH requests), and steps switching between trees and chains stay
    exact; one host sync per tree step."""
    from specdec.engine.verify_policy import TREE
    from specdec.runtime.target_runner import TREE_GRAPH_MAX_BATCH

    eager = make_engine(model_dirs, True, "auto", True, verify="tree", tree_nodes=31)
    trees = make_engine(model_dirs, True, "auto", False, verify="tree", tree_nodes=31)
    graphs = make_engine(model_dirs, True, "auto", False, verify="auto", tree_nodes=31)
    tree = trees.decoding.tree
    assert tree.building.graphs and tree.acceptance.graphs
    measured = graphs.decoding.policy.costs.verify[TREE]
    assert measured and all(s > 0 for s in measured.values())
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    report = {"tree_seconds": measured, "batches": {}}
    for batch, per_step in ((2, 2), (24, 3), (100, 20)):
        ids = prompts(batch)
        want, got = staggered(eager, ids, params, per_step), staggered(trees, ids, params, per_step)
        diverged = divergences(eager, want, got)
        report["batches"][batch] = {"divergences": diverged,
                                    "verified": sorted({q for r in got for q in r.stats.verify_lengths}),
                                    "tau": sum(sum(r.stats.acceptance_lengths) for r in got)
                                    / sum(len(r.stats.acceptance_lengths) for r in got)}
        assert all(abs(d["logit_gap"]) <= NEAR_TIE for d in diverged), diverged
        assert max(q for r in got for q in r.stats.verify_lengths) == 32  # 31 nodes at every batch
        for engine in (eager, trees):
            assert engine.pool.num_free == engine.pool.num_pages
    # auto wanting trees at every batch: 20 requests arriving at once run more than TREE_GRAPH_MAX_BATCH, whose
    # KV room is a chain's, so they verify chains
    force_trees_below(graphs, 1024)
    got = staggered(graphs, prompts(100), params, 20)
    assert 20 > TREE_GRAPH_MAX_BATCH and max(q for r in got for q in r.stats.verify_lengths) == BLOCK
    assert graphs.pool.num_free == graphs.pool.num_pages
    force_trees_below(graphs, 8)  # chains from 8 requests on: steps switch as arrivals fill the batch
    want, got = staggered(eager, prompts(24), params, 3), staggered(graphs, prompts(24), params, 3)
    assert all(abs(d["logit_gap"]) <= NEAR_TIE for d in divergences(eager, want, got))
    assert {BLOCK, 32} <= {q for r in got for q in r.stats.verify_lengths}
    force_trees_below(graphs, 1024)
    for batch in (2, 5):
        syncs = synchronizations_in_one_step(graphs, batch, {})
        assert len(syncs) == 1, syncs
        syncs = synchronizations_in_a_step_with_an_arrival(graphs, batch, {})
        assert len(syncs) == 1, syncs
    assert graphs.pool.num_free == graphs.pool.num_pages
    print(json.dumps(report))


@pytest.mark.parametrize("drafter", [False, True], ids=["ar", "dflash"])
def test_a_batch_with_one_long_request_runs_its_steps_as_mixed_steps_with_eagers_tokens(model_dirs, drafter):
    """64 requests keep each one's KV in one piece in their rung, but not where one request is far longer than the
    others (its CTA would be the whole step's tail): those steps run as mixed steps, planned with split-KV, and give
    the eager engine's tokens (near-ties aside), as do the steps once the long request has finished."""
    from attention.flashinfer_backend import ONE_PIECE_MAX_EXCESS, ONE_PIECE_MIN_BATCH

    size = ONE_PIECE_MIN_BATCH
    eager, graphs = (make_engine(model_dirs, drafter, "auto", e, max_num_seqs=size) for e in (True, False))
    ids = prompts(size)
    ids[0] = (ids[0] * 4000)[:ONE_PIECE_MAX_EXCESS + 800]  # past the others' mean by more than the excess allowed
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] + [SamplingParams(max_new_tokens=24,
                                                                                     ignore_eos=True)] * (size - 1)
    runner, mixed = graphs.runner, []  # (requests, prefill, tree) of each mixed step
    run_mixed = runner._run_mixed

    def recorded(tables, *args, **kwargs):
        mixed.append((len(tables), args[3], kwargs.get("tree")))
        return run_mixed(tables, *args, **kwargs)

    runner._run_mixed = recorded
    want = [eager.make_request(p, sp) for p, sp in zip(ids, params)]
    eager.run(want)
    got = [graphs.make_request(p, sp) for p, sp in zip(ids, params)]
    graphs.run(got)
    declined = [batch for batch, prefill, tree in mixed if prefill is None and tree is None]
    assert declined and all(batch == size for batch in declined), mixed
    diverged = divergences(eager, want, got)
    assert all(d["logit_gap"] <= NEAR_TIE for d in diverged), diverged
    assert graphs.pool.num_free == graphs.pool.num_pages

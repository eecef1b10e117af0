"""Speculation over token trees (verify="tree") is exact: greedy output equals autoregressive output, with
arrivals, preemption-free and preempting pools, EOS and length limits; no page leaks."""

import pytest

from specdec.engine.sampling_params import SamplingParams
from tests.engine_helpers import (MANY_PROMPTS, assert_no_leak, dflash_drafter, follow_the_target, module_target,
                                  spec_engine, tiny_engine)


target_dir = module_target("tree-spec", seed=9)


def ar_outputs(path, prompts, params, eos=()):
    return [r.output_ids for r in tiny_engine(path, eos=eos).generate_ids(prompts, params)]


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_tree_greedy_equals_autoregressive(target_dir, tmp_path, batch, block_size):
    prompts = MANY_PROMPTS[:batch]
    params = SamplingParams(max_new_tokens=23)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, block_size), verify="tree",
                         attention_backend="torch", max_num_seqs=max(1, batch - 1),  # the last one arrives later
                         tree_nodes=block_size - 1)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == ar_outputs(target_dir, prompts, params)
    assert all(r.stats.verify_lengths and set(r.stats.verify_lengths) == {block_size} for r in got)
    if block_size >= 4:  # drafts were accepted, so later steps read K/V moved into place
        assert max(n for r in got for n in r.stats.acceptance_lengths) > 1
    assert_no_leak(engine)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_deep_paths_through_second_candidates_are_moved_into_place(target_dir, tmp_path, batch, error_rate):
    """A drafter whose drafts follow the target, each wrong with `error_rate` and then its second candidate right
    (`follow_the_target`): the accepted paths run deep and through nodes other than their depth's slot, so their K/V
    must move into place for the next step to read; outputs stay plain decoding's and no page leaks."""
    prompts, params = MANY_PROMPTS[:batch], SamplingParams(max_new_tokens=40)
    expected = ar_outputs(target_dir, prompts, SamplingParams(max_new_tokens=48))
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 8), verify="tree", tree_nodes=20,
                         num_kv_pages=256)
    follow_the_target(engine.drafter, {tuple(p): e for p, e in zip(prompts, expected)}, error_rate)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == [e[:40] for e in expected]
    assert max(n for r in got for n in r.stats.acceptance_lengths) >= 5
    assert_no_leak(engine)


@pytest.mark.parametrize("batch, max_num_seqs", [(1, 1), (4, 4), (6, 3)])
def test_trees_larger_than_the_block_are_exact_and_shrink_with_the_batch(target_dir, tmp_path, batch, max_num_seqs):
    """20 nodes at block 4 (three draft positions, depth <= 3): the tree's extra slots are written and
    rolled back; a step verifies at most max(max_num_seqs x block, 21) rows, so b requests get 21 // b - 1."""
    prompts = MANY_PROMPTS[:batch]
    params = SamplingParams(max_new_tokens=30)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), verify="tree",
                         attention_backend="torch", max_num_seqs=max_num_seqs, tree_nodes=20, num_kv_pages=64)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == ar_outputs(target_dir, prompts, params)
    verified = {q for r in got for q in r.stats.verify_lengths}
    allowed = {min(20, 21 // b - 1) + 1 for b in range(1, max_num_seqs + 1)}  # anchor + nodes at b requests
    assert verified <= allowed and max(verified) > 4 and (max_num_seqs > 1 or verified == {21})
    assert_no_leak(engine)


def test_a_lone_requests_tree_has_at_most_the_rows_the_backend_attends_as_decodes(target_dir, tmp_path, monkeypatch):
    """Where the backend gives a decode's bits only to small trees of a lone request (`exact_tree_rows`: the
    FlashInfer backend's node rows), a lone request's tree is that small; trees of several requests keep tree_nodes
    (less as the block rows run out), and both stay exact."""
    from attention.torch_backend import TorchBackend

    monkeypatch.setattr(TorchBackend, "exact_tree_rows", lambda self: 6)
    params = SamplingParams(max_new_tokens=30)
    drafter = dflash_drafter(target_dir, tmp_path, 4)
    for prompts, max_num_seqs, allowed in (
            (MANY_PROMPTS[:1], 1, {6}),  # 5 nodes of the 20 asked for
            (MANY_PROMPTS[:3], 3, {6, 21 // 2, 21 // 3})):  # 20 + 1 block rows: 9 nodes at 2 requests, 6 at 3
        engine = spec_engine(target_dir, drafter, verify="tree", attention_backend="torch",
                             max_num_seqs=max_num_seqs, tree_nodes=20, num_kv_pages=64)
        got = engine.generate_ids(prompts, params)
        assert [r.output_ids for r in got] == ar_outputs(target_dir, prompts, params)
        verified = {q for r in got for q in r.stats.verify_lengths}
        assert verified <= allowed and max(allowed) in verified
        assert_no_leak(engine)


@pytest.mark.parametrize("tree_nodes", [1, 2])
def test_trees_of_fewer_nodes_than_the_blocks_positions_are_exact(target_dir, tmp_path, tree_nodes):
    """1 or 2 nodes at block 8 (seven draft positions): a path is at most as deep as the tree, and the K/V moves of
    the positions past it are parked on the scratch page."""
    prompts = MANY_PROMPTS[:3]
    params = SamplingParams(max_new_tokens=25)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 8), verify="tree",
                         attention_backend="torch", max_num_seqs=3, tree_nodes=tree_nodes)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == ar_outputs(target_dir, prompts, params)
    assert {q for r in got for q in r.stats.verify_lengths} == {tree_nodes + 1}
    assert max(n for r in got for n in r.stats.acceptance_lengths) <= tree_nodes + 1
    assert_no_leak(engine)


def test_tree_stops_at_eos_and_in_a_small_pool(target_dir, tmp_path):
    prompts = MANY_PROMPTS[:6]
    params = SamplingParams(max_new_tokens=40)
    eos = (7, 11)
    want = ar_outputs(target_dir, prompts, params, eos=eos)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), eos=eos, verify="tree",
                         attention_backend="torch", num_kv_pages=40, max_num_seqs=4, tree_nodes=9)
    got = engine.generate_ids(prompts, params)
    assert [r.output_ids for r in got] == want
    assert_no_leak(engine)


def test_tree_needs_a_drafter_with_candidates(target_dir, tmp_path):
    from tests.drafter_helpers import ScriptedDrafter

    with pytest.raises(ValueError, match="candidates"):  # refused before anything is built
        spec_engine(target_dir, ScriptedDrafter({}, 4, 64), verify="tree", attention_backend="torch")
    engine = spec_engine(target_dir, ScriptedDrafter({}, 4, 64), verify="auto", attention_backend="torch")
    assert engine.decoding.policy.options == (1, 2, 4)  # plain steps and chains, no trees


def test_auto_reserves_a_trees_slots_only_where_a_batch_may_verify_one(target_dir, tmp_path):
    """auto runs trees at up to 16 requests: only steps planned at those batch sizes (an empty batch and a lone
    request too, so that the room never grows with the batch) hold a tree's slots past each request's length, larger
    batches a chain's (verify="tree": every batch)."""
    drafter = dflash_drafter(target_dir, tmp_path, 8)
    auto = spec_engine(target_dir, drafter, verify="auto", max_num_seqs=20).scheduler
    assert [auto.room(b) for b in (0, 1, 2, 16, 17, 20)] == [64, 64, 64, 64, 8, 8]
    tree = spec_engine(target_dir, drafter, verify="tree", max_num_seqs=20, tree_nodes=20).scheduler
    assert [tree.room(b) for b in (1, 17)] == [21, 21]
    assert spec_engine(target_dir, drafter, verify="chain").scheduler.room(3) == 8


def test_more_than_16_requests_under_auto_hold_a_chains_slots_and_run_together(target_dir, tmp_path):
    """24 requests in a pool of 340 pages of 4: past 16 running, each holds a chain's 8 slots ahead instead of a
    tree's 64, so all 24 run at once, without a preemption (holding 64 slots each, at most 18 ran and 5 were
    preempted); outputs stay plain decoding's."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = [[(7 * i + j) % 60 + 3 for j in range(8)] for i in range(24)]
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 8), verify="auto", num_kv_pages=340,
                         max_num_seqs=24, overlap_steps=False)
    requests = [engine.add_request(p, params) for p in prompts]
    most, preempted = 0, 0
    for _ in range(400):
        if not engine.has_unfinished_requests:
            break
        preempted += len(engine.step().preempted)
        most = max(most, len(engine.scheduler.running))
    assert [r.output_ids for r in requests] == ar_outputs(target_dir, prompts, params)
    assert most == 24 and preempted == 0
    assert_no_leak(engine)


def test_a_step_whose_plan_held_a_chains_slots_verifies_a_chain(target_dir, tmp_path):
    """The policy wants a tree at every step, but each step's plan holds a chain's slots only (as when more requests
    ran at planning than decode): every step verifies a chain, exactly, and no page runs out."""
    params = SamplingParams(max_new_tokens=20)
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 4), verify="auto", max_num_seqs=3,
                         num_kv_pages=64, tree_nodes=20)
    decoding = engine.decoding
    decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: (
        0 if trees and batch > 1 else 4)  # TREE where allowed
    engine.scheduler.room = lambda batch: 4
    got = engine.generate_ids(MANY_PROMPTS[:5], params)
    assert [r.output_ids for r in got] == ar_outputs(target_dir, MANY_PROMPTS[:5], params)
    assert {q for r in got for q in r.stats.verify_lengths} == {4}
    assert_no_leak(engine)


def test_a_lone_trees_fused_building_and_acceptance_equal_autoregressive(target_dir, tmp_path, monkeypatch):
    """A lone request's tree building and acceptance through their fused functions (attention/fused.py; here traced by
    torch.compile with its eager backend, on the GPU compiled into Triton kernels): the engine hands them the same
    arguments and reads the same results as the functions as written, so outputs stay plain decoding's."""
    from attention import fused as fused_module
    from specdec.engine import tree_speculator

    compiled, fused = [], fused_module.fused

    def traced(fn):
        compiled.append(fn.__name__)
        return fused(fn, backend="aot_eager")

    monkeypatch.setattr(fused_module, "fused", traced)
    prompts, params = MANY_PROMPTS[:1], SamplingParams(max_new_tokens=40)
    expected = ar_outputs(target_dir, prompts, SamplingParams(max_new_tokens=48))
    engine = spec_engine(target_dir, dflash_drafter(target_dir, tmp_path, 8), verify="tree", tree_nodes=15,
                         num_kv_pages=256)
    engine.decoding.tree.fuse = True  # as graphs captured on a GPU with Triton leave it
    follow_the_target(engine.drafter, {tuple(p): e for p, e in zip(prompts, expected)}, 0.3)
    got = engine.generate_ids(prompts, params)
    assert {"build_trees", "accept_trees"} <= set(compiled)
    assert not any(fused(fn, backend="aot_eager").failed
                   for fn in (tree_speculator.build_trees, tree_speculator.accept_trees))  # none fell back
    assert [r.output_ids for r in got] == [e[:40] for e in expected]
    assert max(n for r in got for n in r.stats.acceptance_lengths) >= 5
    assert_no_leak(engine)

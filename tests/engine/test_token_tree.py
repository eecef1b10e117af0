"""Token trees from the drafter's per-position candidates: built as the best-scoring prefix-closed node set,
seen through an ancestor mask, accepted along the one path the target agrees with."""

import itertools

import pytest
import torch

from specdec.engine.acceptance import accept as accept_chain
from specdec.engine import token_tree
from specdec.engine.token_tree import TokenTree


def candidates(batch, n, k, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, n, vocab, generator=g) * 2
    logprobs, tokens = logits.log_softmax(-1).topk(k, dim=-1)
    return logprobs, tokens


def brute_force_best(logprobs, tokens, budget):
    """Every path of ranks up to depth n, scored; the budget best as tuples of tokens."""
    n, k = logprobs.shape
    paths = []
    for depth in range(1, n + 1):
        for ranks in itertools.product(range(k), repeat=depth):
            score = sum(logprobs[d, r].item() for d, r in enumerate(ranks))
            paths.append((score, tuple(tokens[d, r].item() for d, r in enumerate(ranks))))
    paths.sort(key=lambda p: -p[0])
    return {p[1] for p in paths[:budget]}


def node_paths(tree, b):
    """Node i's tokens from the anchor down, for request b."""
    out = {0: ()}
    for i in range(tree.size):
        out[i + 1] = out[tree.parents[b, i].item()] + (tree.tokens[b, i].item(),)
    return out


@pytest.mark.parametrize("n, k, budget", [(4, 3, 10), (5, 2, 31), (3, 4, 7), (6, 3, 1), (3, 2, 14)])
def test_the_tree_is_the_best_nodes_and_parents_come_first(n, k, budget):
    logprobs, tokens = candidates(3, n, k, seed=n * 10 + k)
    tree = TokenTree.build(logprobs, tokens, budget)
    assert tree.size == min(budget, sum(k ** d for d in range(1, n + 1)))
    for b in range(3):
        parents = tree.parents[b].tolist()
        assert all(p <= i for i, p in enumerate(parents))  # node i + 1's parent is an earlier node or the anchor
        paths = node_paths(tree, b)
        assert set(list(paths.values())[1:]) == brute_force_best(logprobs[b], tokens[b], budget)
        assert all(len(paths[i + 1]) == tree.depths[b, i].item() for i in range(tree.size))
        scores = tree.scores[b].tolist()
        assert scores == sorted(scores, reverse=True)


def two_sure_choices_then_sure_firsts(batch, n, k):
    """Two about equally likely candidates at each of the first three positions, then sure first candidates: the
    best 15 nodes are the 14 of the full binary tree over those positions and one more below it, the deepest fan-out
    a tree of 15 nodes can have (every node leaves the first candidates at up to 3 positions)."""
    logprobs = torch.tensor([-5.0, -6.0, -7.0, -8.0][:k]).repeat(batch, n, 1)
    logprobs[:, :3, :2] = torch.tensor([-0.69, -0.70])
    logprobs[:, :3, 2:] = -20.0
    return logprobs, torch.arange(batch * n * k).view(batch, n, k)


@pytest.mark.parametrize("n, k, budget, sure", [(15, 4, 15, True), (15, 4, 31, True), (6, 3, 20, False),
                                                 (15, 2, 12, True), (15, 4, 15, "fan-out")])
def test_trees_from_every_possible_node_equal_trees_built_depth_by_depth(n, k, budget, sure):
    """Small trees are chosen among every node that may be among the best at once; larger ones depth by depth, from
    each depth's best. Both give the same tree."""
    if sure == "fan-out":
        logprobs, tokens = two_sure_choices_then_sure_firsts(3, n, k)
    else:
        logprobs, tokens = candidates(3, n, k, seed=budget)
        if sure:  # deep paths, branching on the way
            logprobs = logprobs - logprobs[:, :, :1] - torch.linspace(0.01, 0.2, n)[None, :, None]
    assert token_tree.possible_nodes(n, k, budget, torch.device("cpu")) is not None
    at_once = TokenTree.build(logprobs, tokens, budget)
    by_depth = TokenTree.build(logprobs, tokens, budget, at_once=False)
    for b in range(3):
        assert set(node_paths(at_once, b).values()) == set(node_paths(by_depth, b).values())
    torch.testing.assert_close(at_once.scores, by_depth.scores)
    if sure == "fan-out":
        assert (at_once.depths <= 4).all() and (at_once.ranks[:, :14] <= 1).all()


def test_only_small_trees_are_chosen_among_every_possible_node():
    """15 nodes of a block of 16 with 4 candidates a position may be any of 633 nodes; 63 nodes go depth by depth."""
    cpu = torch.device("cpu")
    assert token_tree.possible_nodes(15, 4, 15, cpu).depths.shape == (633,)
    assert token_tree.possible_nodes(15, 4, 63, cpu) is None


def test_a_certain_draft_still_comes_after_its_parent():
    """Probability 1 gives a child its parent's score: the tree must still list the parent first."""
    logprobs = torch.tensor([[[0.0, -30.0], [0.0, -30.0], [0.0, -30.0]]])
    tokens = torch.tensor([[[5, 6], [7, 8], [9, 10]]])
    tree = TokenTree.build(logprobs, tokens, 3)
    assert tree.tokens.tolist() == [[5, 7, 9]] and tree.parents.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("n, k, budget", [(4, 3, 12), (15, 4, 63), (15, 2, 40)])
def test_the_mask_lets_each_node_see_its_ancestors_and_itself(n, k, budget):
    """Also for trees as deep as a block of 16 allows, whose masks take every pass of the pointer doubling."""
    logprobs, tokens = candidates(2, n, k, seed=7)
    if n > 4:  # surer first candidates: deep paths, branching on the way
        logprobs = logprobs - logprobs[:, :, :1] - torch.linspace(0.01, 0.2, n)[None, :, None]
    tree = TokenTree.build(logprobs, tokens, budget)
    assert n == 4 or tree.depths.max() >= 8  # ancestors more than 7 generations up: the fourth doubling pass
    mask = tree.attention_mask()
    for b in range(2):
        parents = [0] + tree.parents[b].tolist()
        for i in range(tree.size + 1):
            ancestors, node = {i}, i
            while node:
                node = parents[node]
                ancestors.add(node)
            assert {j for j in range(tree.size + 1) if mask[b, i, j]} == ancestors


def reference_accept(tree, target, b):
    """Walk from the anchor: the child whose token is the target's choice, while there is one."""
    node, path = 0, []
    while True:
        child = next((i + 1 for i in range(tree.size) if tree.parents[b, i] == node
                      and tree.tokens[b, i] == target[b, node]), None)
        if child is None:
            return path, target[b, node].item()
        path.append(child)
        node = child


@pytest.mark.parametrize("seed", range(6))
def test_acceptance_follows_the_one_path_the_target_agrees_with(seed):
    logprobs, tokens = candidates(4, 5, 3, seed=seed)
    tree = TokenTree.build(logprobs, tokens, 20)
    g = torch.Generator().manual_seed(100 + seed)
    # the target mostly picks some candidate of the next position, sometimes something else
    target = torch.empty(4, tree.size + 1, dtype=torch.long)
    for b in range(4):
        for node in range(tree.size + 1):
            depth = 0 if node == 0 else tree.depths[b, node - 1].item()
            pick = torch.randint(0, 4, (1,), generator=g).item()
            target[b, node] = tokens[b, depth, pick].item() if depth < 5 and pick < 3 else 999
    path, accepted, bonus = tree.accept(target)
    for b in range(4):
        want_path, want_bonus = reference_accept(tree, target, b)
        assert accepted[b].item() == len(want_path) and bonus[b].item() == want_bonus
        assert path[b, :len(want_path)].tolist() == want_path


def test_one_candidate_per_position_is_the_chain():
    logprobs, tokens = candidates(3, 6, 1, seed=3)
    tree = TokenTree.build(logprobs, tokens, 6)
    assert tree.parents.tolist() == [[0, 1, 2, 3, 4, 5]] * 3
    assert torch.equal(tree.tokens, tokens[:, :, 0])
    drafts = tokens[:, :, 0]
    # the target's choice after the anchor and after each draft: the next draft, then its own bonus
    target = torch.cat([drafts, torch.full((3, 1), 999)], dim=1)
    target[0, 2] = 998  # request 0: after draft 2 the target disagrees with draft 3
    target[1, 0] = 998  # request 1: not even the first draft
    _, accepted, bonus = tree.accept(target)
    want_accepted, want_bonus = accept_chain(drafts, target)
    assert accepted.tolist() == want_accepted.tolist() == [2, 0, 6]
    assert bonus.tolist() == want_bonus.tolist() == [998, 998, 999]


def test_candidates_past_the_first_kept_out_make_the_chain_in_depth_order():
    """What a lone tree step does where its node rows would straddle a KV chunk boundary: every candidate past each
    position's first scored NOT_A_CANDIDATE, the tree of as many nodes as positions is the chain, node i at depth i
    (the host then knows its shape), with a mask in causal order."""
    from specdec.engine.tree_speculator import NOT_A_CANDIDATE

    logprobs, tokens = candidates(2, 15, 4, seed=5)
    logprobs[:, :, 1:] = NOT_A_CANDIDATE
    tree = TokenTree.build(logprobs, tokens, 15)
    assert tree.parents.tolist() == [list(range(15))] * 2 and tree.depths.tolist() == [list(range(1, 16))] * 2
    assert torch.equal(tree.tokens, tokens[:, :, 0]) and (tree.ranks == 0).all()
    assert torch.equal(tree.attention_mask(), torch.ones(2, 16, 16, dtype=torch.bool).tril())


def test_one_forward_over_a_tree_gives_each_node_the_logits_of_its_own_path(tmp_path):
    """The target verifies a whole tree at once: K/V written in node order, RoPE at the anchor's position
    plus each node's depth, each node attending to the context, its ancestors and itself. Every node's
    logits equal those of the target run on the context followed by that node's path."""
    import numpy as np

    from attention.page_pool import PageTable
    from specdec.engine.request import Request
    from specdec.engine.sampling_params import SamplingParams
    from tests.conftest import VOCAB, build_tiny_model
    from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, tiny_engine

    build_tiny_model("qwen3", tmp_path, seed=11)
    engine = tiny_engine(tmp_path, eos=())
    context, anchor = MANY_PROMPTS[2], 17
    g = torch.Generator().manual_seed(5)
    logprobs = torch.randn(1, 4, VOCAB, generator=g).log_softmax(-1)
    tree = TokenTree.build(*logprobs.topk(3, dim=-1), budget=11)
    probe = Request(-1, context, SamplingParams(max_new_tokens=1), ())
    probe.target_pages = PageTable(engine.pool)
    try:
        with torch.no_grad():
            engine.forward_tokens([probe], engine.ids_tensor(context), [len(context)], logits_rows=None)
            ids = [anchor, *tree.tokens[0].tolist()]
            positions = len(context) + np.array([0, *tree.depths[0].tolist()])
            out = engine.runner.forward([probe.target_pages], engine.ids_tensor(ids), [len(ids)],
                                        logits_rows=engine.ids_tensor(range(len(ids))), positions=positions,
                                        query_masks=tree.attention_mask())
    finally:
        probe.target_pages.free()
    paths = node_paths(tree, 0)
    for node in range(len(ids)):
        want = engine.next_token_logits(context + [anchor, *paths[node]])
        torch.testing.assert_close(out.logits[node].float(), want, atol=1e-4, rtol=1e-4)
    assert_no_leak(engine)

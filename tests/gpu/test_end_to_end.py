"""End to end on the GPU with a real demo model: greedy speculative output vs greedy
autoregressive output of the same engine, through FlashInfer, with bf16 and FP8 KV caches.

bf16 kernels can flip near-ties between a 16-token verify and a 1-token decode in a batch. Every
divergence is reported with its position and the logit gap between the two tokens under the
autoregressive engine; a gap beyond NEAR_TIE either way is a bug, and so is any divergence at
batch 1 (one prompt at a time), where the kernels compute decode and verify rows alike.
"""

import json
import os

import pytest
import torch

from specdec import LLM, SamplingParams, StructuredOutput
from tests.drafter_helpers import ScriptedDrafter, build_random_drafter
from tests.gpu.gpu_helpers import MODEL, PROMPTS

NEAR_TIE, NEW_TOKENS, BATCH_ONE_PROMPTS = 0.5, 96, 4
LOGIT_STEP = 0.25  # two bf16 steps of a logit between 16 and 32


def report(name, data):
    folder = os.environ.get("SPECDEC_REPORT_DIR")
    if folder:
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    from transformers import AutoConfig

    from specdec.weights.demo_models import resolve_model

    path = tmp_path_factory.mktemp("gpu-drafter")
    target_config = AutoConfig.from_pretrained(resolve_model(MODEL))
    build_random_drafter(path, target_config, block_size=16, num_layers=2, heads=8, kv_heads=2, head_dim=64,
                         intermediate_size=1024, std=0.02, mask_token_id=0)
    return path


def compare(ar_llm, spec_llm, label, params=None):
    params = params or SamplingParams(max_new_tokens=NEW_TOKENS)
    ar = ar_llm.generate(PROMPTS, params, chat=True)
    spec = spec_llm.generate(PROMPTS, params, chat=True)
    divergences = []
    for i, (a, s) in enumerate(zip(ar, spec)):
        if a.token_ids == s.token_ids:
            continue
        pos = next((p for p, (x, y) in enumerate(zip(a.token_ids, s.token_ids)) if x != y),
                   min(len(a.token_ids), len(s.token_ids)))
        if pos == min(len(a.token_ids), len(s.token_ids)):
            divergences.append({"prompt": i, "position": pos, "kind": "length"})
            continue
        logits = ar_llm.engine.next_token_logits(a.prompt_token_ids + a.token_ids[:pos])
        if params.frequency_penalty:  # the logits the engine chose from
            previous = torch.tensor(a.token_ids[:pos], dtype=torch.long, device=logits.device)
            logits = logits - params.frequency_penalty * torch.bincount(previous, minlength=logits.numel()).float()
        gap = (logits[a.token_ids[pos]] - logits[s.token_ids[pos]]).item()
        divergences.append({"prompt": i, "position": pos, "ar_token": a.token_ids[pos],
                            "spec_token": s.token_ids[pos], "logit_gap": gap})
    match_rate = 1 - len(divergences) / len(PROMPTS)
    summary = spec_llm.last_summary
    data = {"label": label, "model": MODEL, "prompts": len(PROMPTS), "match_rate": match_rate,
            "divergences": divergences, "tau": summary.tau_mean_of_requests,
            "spec_tokens_per_s": summary.tokens_per_s, "ar_tokens_per_s": ar_llm.last_summary.tokens_per_s}
    print(json.dumps(data))
    report(label, data)
    assert not [d for d in divergences if d.get("kind") == "length"], data
    assert all(abs(d["logit_gap"]) <= NEAR_TIE for d in divergences), data
    return ar


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_dflash_speculative_equals_autoregressive(drafter_dir, kv):
    ar_llm = LLM(MODEL, device="cuda", kv_cache_dtype=kv, num_kv_pages=2048, attention_backend="flashinfer")
    spec_llm = LLM(MODEL, drafter=drafter_dir, device="cuda", kv_cache_dtype=kv, num_kv_pages=2048,
                   attention_backend="flashinfer")
    compare(ar_llm, spec_llm, f"dflash-random-{kv}")
    assert spec_llm.engine.pool.num_free == spec_llm.engine.pool.num_pages


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_high_acceptance_speculation_equals_autoregressive(kv):
    """A drafter that proposes the autoregressive continuation (mostly accepted) on the GPU path."""
    ar_llm = LLM(MODEL, device="cuda", kv_cache_dtype=kv, num_kv_pages=2048, attention_backend="flashinfer")
    ar = ar_llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), chat=True)
    script = {tuple(r.prompt_token_ids): r.token_ids for r in ar}
    drafter = ScriptedDrafter(script, 16, ar_llm.engine.model.config.vocab_size, error_rate=0.1)
    spec_llm = LLM(MODEL, drafter=drafter, device="cuda", kv_cache_dtype=kv, num_kv_pages=2048,
                   attention_backend="flashinfer")
    compare(ar_llm, spec_llm, f"scripted-{kv}")


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_batch_one_speculation_is_exact(drafter_dir, kv):
    """One prompt at a time: no padding and no batch-dependent kernels, so not even a near-tie may flip."""
    common = dict(device="cuda", kv_cache_dtype=kv, num_kv_pages=2048, attention_backend="flashinfer")
    ar_llm, spec_llm = LLM(MODEL, **common), LLM(MODEL, drafter=drafter_dir, **common)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:BATCH_ONE_PROMPTS]:
        want = ar_llm.generate([prompt], params, chat=True)[0].token_ids
        assert spec_llm.generate([prompt], params, chat=True)[0].token_ids == want, prompt


def test_a_shorter_max_model_len_is_exact_and_ends_answers_at_it():
    """max_model_len below the model's context (which sizes a lone request's attention rows and the RoPE tables):
    a lone request's speculation with a mostly accepted drafter equals plain decoding, cut where the length ends."""
    common = dict(device="cuda", num_kv_pages=2048, attention_backend="flashinfer", max_model_len=96)
    ar_llm = LLM(MODEL, **common)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    ar = [ar_llm.generate([prompt], params, chat=True)[0] for prompt in PROMPTS[:BATCH_ONE_PROMPTS]]
    script = {tuple(r.prompt_token_ids): r.token_ids for r in ar}
    drafter = ScriptedDrafter(script, 16, ar_llm.engine.model.config.vocab_size, error_rate=0.1)
    spec_llm = LLM(MODEL, drafter=drafter, **common)
    for want in ar:
        got = spec_llm.generate([want.prompt_token_ids], params)[0]
        assert got.token_ids == want.token_ids
        assert len(want.prompt_token_ids) + len(want.token_ids) <= 96
    assert any(len(r.prompt_token_ids) + len(r.token_ids) == 96 and r.finish_reason == "length" for r in ar)


def test_a_lone_request_verifies_the_whole_chain_whatever_the_costs(drafter_dir):
    """verify="auto" measures every chain length's step time after capture; costs that make a chain of 4 far cheaper
    (forced here) leave a lone request the whole chain (at batch 1 every length streams the weights once, and only
    the whole chain keeps plain decoding's bits), and its output is decoding one prompt at a time."""
    from specdec.engine.verify_policy import PLAIN, TREE, StepCosts

    common = dict(device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    ar_llm, spec_llm = LLM(MODEL, **common), LLM(MODEL, drafter=drafter_dir, verify="auto", **common)
    policy = spec_llm.engine.decoding.policy
    assert policy.options == (PLAIN, 2, 4, 6, 8, 16, TREE) and set(policy.costs.verify) == {PLAIN, 2, 4, 6, 8, 16, TREE}
    assert set(policy.costs.draft) == {2, 4, 6, 8, 16, TREE}  # a plain step drafts nothing
    for costs in (policy.costs.verify, policy.costs.draft):
        assert all(s > 0 for by_rung in costs.values() for s in by_rung.values())
    rungs = policy.costs.verify[16]
    slow = dict.fromkeys(rungs, 9.0)
    policy.costs = StepCosts({}, {2: slow, 4: dict.fromkeys(rungs, 1.0), 8: slow, 16: slow, TREE: slow})
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:BATCH_ONE_PROMPTS]:
        want = ar_llm.generate([prompt], params, chat=True)[0].token_ids
        assert spec_llm.generate([prompt], params, chat=True)[0].token_ids == want, prompt
    assert spec_llm.last_summary.verified_per_step == 16  # every step verified the whole chain


def test_plain_steps_between_chains_are_exact_at_batch_one(drafter_dir):
    """auto's plain steps (PLAIN, forced here for two steps of every three) replay the plain decode step's graph,
    overlapped, while the drafter's context keeps up; with the chains between them they reproduce plain decoding."""
    from specdec.engine.verify_policy import PLAIN

    common = dict(device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    ar_llm, spec_llm = LLM(MODEL, **common), LLM(MODEL, drafter=drafter_dir, verify="auto", **common)
    decoding = spec_llm.engine.decoding
    assert PLAIN in decoding.policy.lengths and decoding.runner.replays(PLAIN, 1)
    calls = iter(range(10**9))
    decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: (
        PLAIN if plain and next(calls) % 3 else 16)
    launch, launched = decoding.launch, []
    decoding.launch = lambda *args, **kwargs: (launched.append(1), launch(*args, **kwargs))[1]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for prompt in PROMPTS[:BATCH_ONE_PROMPTS]:
        want = ar_llm.generate([prompt], params, chat=True)[0].token_ids
        assert spec_llm.generate([prompt], params, chat=True)[0].token_ids == want, prompt
    assert len(launched) > 10 and spec_llm.last_summary.verify_steps > 10  # both kinds of step ran


@pytest.mark.parametrize("verify", ["tree", "auto"])
def test_token_trees_equal_autoregressive(verify):
    """Token trees on the GPU path (FlashInfer's fa2 kernels with the trees' custom mask; decoding runs other
    kernels, so a near-tie may flip, but nothing more), with a drafter whose corrupted drafts the tree recovers from
    its second candidates: batched, then one prompt at a time (where auto verifies the whole chain and a tree is one
    of node rows: test_token_trees_at_batch_one_equal_autoregressive checks those token for token)."""
    from tests.drafter_helpers import ScriptedTreeDrafter

    common = dict(device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    ar_llm = LLM(MODEL, **common)
    ar = ar_llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), chat=True)
    script = {tuple(r.prompt_token_ids): r.token_ids for r in ar}
    drafter = ScriptedTreeDrafter(script, 16, ar_llm.engine.model.config.vocab_size, error_rate=0.3)
    spec_llm = LLM(MODEL, drafter=drafter, verify=verify, **common)
    if verify == "tree":
        compare(ar_llm, spec_llm, "tree-scripted")
    ar_one, spec_one = LLM(MODEL, **common, max_num_seqs=1), LLM(MODEL, drafter=drafter, verify=verify,
                                                                  max_num_seqs=1, **common)
    compare(ar_one, spec_one, f"{verify}-scripted-batch-1")
    if verify == "tree":  # a lone request's tree: the 15 nodes its node rows attend with a decode's bits
        assert spec_one.last_summary.verified_per_step == 16
    assert spec_one.engine.pool.num_free == spec_one.engine.pool.num_pages


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_token_trees_at_batch_one_equal_autoregressive(kv):
    """A lone request's tree (15 nodes, 16 rows, whatever tree_nodes asks for above that) runs as node rows
    (attention/node_rows.py): each node attends over the context and its path in a decode's KV chunks, so token for
    token what plain decoding gives. Every step replays the tree rung's graph: where a KV chunk boundary falls inside
    a tree, the tree is the chain of first candidates, whose shape the host plans."""
    from tests.drafter_helpers import ScriptedTreeDrafter

    common = dict(device="cuda", num_kv_pages=2048, attention_backend="flashinfer", kv_cache_dtype=kv,
                  max_num_seqs=1)
    ar_llm = LLM(MODEL, **common)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    ar = ar_llm.generate(PROMPTS, params, chat=True)
    script = {tuple(r.prompt_token_ids): r.token_ids for r in ar}
    drafter = ScriptedTreeDrafter(script, 16, ar_llm.engine.model.config.vocab_size, error_rate=0.3)
    spec_llm = LLM(MODEL, drafter=drafter, verify="tree", **common)  # tree_nodes 63 by default
    runner = spec_llm.engine.decoding.runner
    assert runner.ladders["tree"].slot(1).node_rows
    run_mixed, eager_trees = runner._run_mixed, []
    runner._run_mixed = lambda *args, tree=None, **kwargs: (
        eager_trees.append(tree is not None), run_mixed(*args, tree=tree, **kwargs))[1]
    run_tree, chains = runner.run_tree, []
    runner.run_tree = lambda tables, anchors, tree: (chains.append(tree.chain), run_tree(tables, anchors, tree))[1]
    spec = spec_llm.generate(PROMPTS, params, chat=True)
    summary = spec_llm.last_summary
    print(json.dumps({"label": f"tree15-node-rows-{kv}", "tau": summary.tau_mean_of_requests,
                      "chain_shaped_steps": sum(chains), "tree_steps": len(chains)}))
    assert summary.verified_per_step == 16 and not any(eager_trees)
    assert 0 < sum(chains) < len(chains)  # trees of every shape, and chains at the KV chunk boundaries
    for i, (a, s) in enumerate(zip(ar, spec)):
        assert s.token_ids == a.token_ids, f"prompt {i}"
    assert spec_llm.engine.pool.num_free == spec_llm.engine.pool.num_pages


def test_logprobs_with_graphs_match_plain_decoding_and_a_direct_forward(drafter_dir):
    """Logprobs read from the verify's rows (CUDA graphs, FlashInfer) against plain decoding's and the
    target's own next-token logits, up to bf16's rounding, wherever both engines chose the same tokens: bf16
    logits near 16-32 are 0.125 apart, so two kernels may differ by that (measured: 0.125 at most); a row
    taken from the wrong position is off by whole units."""
    params = SamplingParams(max_new_tokens=24, logprobs=5)
    ar_llm = LLM(MODEL, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    spec_llm = LLM(MODEL, drafter=drafter_dir, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    checked = 0
    for a, s in zip(ar_llm.generate(PROMPTS, params, chat=True), spec_llm.generate(PROMPTS, params, chat=True)):
        assert len(a.logprobs) == len(a.token_ids) and len(s.logprobs) == len(s.token_ids)
        same = next((p for p, (x, y) in enumerate(zip(a.token_ids, s.token_ids)) if x != y), len(a.token_ids))
        for p in range(same):
            assert s.logprobs[p].token == a.logprobs[p].token == a.token_ids[p]
            assert abs(s.logprobs[p].logprob - a.logprobs[p].logprob) <= LOGIT_STEP
            checked += 1
        direct = torch.log_softmax(ar_llm.engine.next_token_logits(a.prompt_token_ids), dim=-1)
        assert abs(direct[a.token_ids[0]].item() - a.logprobs[0].logprob) <= LOGIT_STEP
    assert checked >= len(PROMPTS) * 4


def test_penalized_speculative_output_equals_penalized_plain_output(drafter_dir):
    """Frequency penalties on the verify rows (counts along the draft, CUDA graphs): greedy speculative output
    equals greedy plain output with the same penalty, near-ties aside."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, frequency_penalty=1.0)
    ar_llm = LLM(MODEL, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    spec_llm = LLM(MODEL, drafter=drafter_dir, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    penalized = compare(ar_llm, spec_llm, "dflash-random-penalized", params)
    plain = ar_llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS), chat=True)
    assert [r.token_ids for r in penalized] != [r.token_ids for r in plain]  # the penalty changed the answers



def test_structured_speculative_output_equals_structured_plain_output():
    """A JSON schema's masks on the verify rows (the grammar walked along the drafts, CUDA graphs): with a
    drafter proposing the constrained plain answer (mostly accepted), greedy speculative output equals greedy
    plain output, near-ties aside, and every finished answer parses as the schema's object."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 80},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=NEW_TOKENS, structured_output=StructuredOutput(json=schema))
    ar_llm = LLM(MODEL, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    ar = ar_llm.generate(PROMPTS, params, chat=True)
    script = {tuple(r.prompt_token_ids): r.token_ids for r in ar}
    drafter = ScriptedDrafter(script, 16, ar_llm.engine.model.config.vocab_size, error_rate=0.1)
    spec_llm = LLM(MODEL, drafter=drafter, device="cuda", num_kv_pages=2048, attention_backend="flashinfer")
    compare(ar_llm, spec_llm, "scripted-json-schema", params)
    finished = [r for r in ar if r.finish_reason == "stop"]
    assert len(finished) >= len(ar) // 2, [r.text for r in ar]
    for result in finished:
        assert set(json.loads(result.text)) == {"answer", "confidence"}, result.text


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_budget_steps_equal_autoregressive(drafter_dir, kv):
    """auto's budget steps (forced at every batch above one, each of its kinds in turn; graphs of the batch's rung,
    whose padding requests take rows the real ones would not have had) against plain decoding, bf16 and FP8."""
    from specdec.engine.verify_policy import Budget
    from specdec.runtime.target_runner import BUDGET_STEP

    common = dict(device="cuda", kv_cache_dtype=kv, num_kv_pages=2048, attention_backend="flashinfer")
    ar_llm = LLM(MODEL, **common)
    spec_llm = LLM(MODEL, drafter=drafter_dir, verify="auto", budget_steps=True, **common)
    decoding = spec_llm.engine.decoding
    budgets = decoding.policy.budgets
    assert budgets == (Budget(4, 2), Budget(6, 3), Budget(8, 5), Budget(16, 8))
    assert all(decoding.runner.replays((BUDGET_STEP, *b), 3) and b in decoding.policy.costs.verify for b in budgets)
    turns = iter(range(10**9))
    decoding.policy.choose = lambda batch, nodes=0, trees=True, plain=True, budgets=True: (
        decoding.policy.budgets[next(turns) % 4] if budgets and batch > 1 else 16)
    shares, step = [], decoding.step

    def recording(running, prefill=None):
        tokens = step(running, prefill)
        shares.append((decoding.option, decoding.request_lengths))
        return tokens

    decoding.step = recording
    compare(ar_llm, spec_llm, f"budget-random-{kv}")
    ran = [(budget, s) for budget, s in shares if s is not None]
    assert len(ran) > 10 and all(sum(s) == budget.per * len(s) and max(s) <= budget.q for budget, s in ran)
    assert spec_llm.engine.pool.num_free == spec_llm.engine.pool.num_pages


def test_a_budget_steps_rows_are_the_chain_steps_rows_in_graphs(drafter_dir):
    """Each budget kind's graph at batches of 1, 3 and 6 (3 and 6 replay rungs with padding requests) against the chain
    step of its q over the same tokens and context: each verified row's logits (laid out as the chain's, as sampling
    reads them), argmax and features are the chain's up to bf16 rounding; the rows not run have argmax -1. One engine
    for all (its graphs are captured once)."""
    from specdec.runtime.target_runner import BUDGET_STEP
    from tests.engine_helpers import budget_step_against_chain

    llm = LLM(MODEL, drafter=drafter_dir, verify="auto", budget_steps=True, device="cuda", num_kv_pages=2048,
              attention_backend="flashinfer")
    engine = llm.engine
    for batch in (1, 3, 6):
        prompts = [[(31 * i + 7 * j) % 5000 + 10 for j in range(20 + 13 * i)] for i in range(batch)]
        for seed, budget in enumerate(engine.decoding.policy.budgets):
            label = (batch, budget)
            assert engine.runner.replays((BUDGET_STEP, *budget), batch), label
            (chain_logits, chain_greedy, chain_features), (logits, greedy, features), lengths = \
                budget_step_against_chain(engine, prompts, budget.q, budget.per, seed)
            assert sum(lengths) == budget.per * batch and all(1 <= n <= budget.q for n in lengths), label
            run = [i * budget.q + j for i, n in enumerate(lengths) for j in range(n)]
            skipped = [r for r in range(batch * budget.q) if r not in set(run)]
            assert (logits[run].float() - chain_logits[run].float()).abs().max() <= 2 * LOGIT_STEP, label
            assert ((features[run].float() - chain_features[run].float()).abs().max()
                    <= 0.02 * chain_features[run].float().abs().max()), label
            top2 = chain_logits[run].float().topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE  # rows whose argmax no rounding can flip
            assert torch.equal(greedy[run][clear], chain_greedy[run][clear]), label
            assert (greedy[skipped] == -1).all(), label
    assert engine.pool.num_free == engine.pool.num_pages

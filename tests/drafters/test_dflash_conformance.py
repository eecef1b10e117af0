"""Our paged DFlash drafter computes the same block logits as the reference formulation:
z-lab's `dflash` package when importable, and always a dense implementation written here from the
documented architecture. Checked on the first step (prompt context) and on a later step (context
cache built incrementally across steps, with rollback)."""

import json

import pytest
import torch

from drafters import load_drafter
from drafters.dflash_model import load_dflash, read_dflash_config, save_dflash
from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB, build_tiny_model
from tests.drafter_helpers import ScriptedDrafter, build_random_drafter
from tests.engine_helpers import tiny_target

PROMPTS = [[5, 17, 33, 9, 11, 40, 41], [7, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]]
BLOCK = 5
SHORT_BLOCKS = (3,)  # the test drafter declares this block besides the whole one


def rotate(x, pos, inv_freq):
    freqs = pos[:, None].float() * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def dense_dflash_logits(sd, cfg, features, block_ids, start, embed, lm_head):
    """One request: features [start, F] of positions 0..start-1, block [bs] at start..start+bs-1."""
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ctx = rms(features @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = embed[block_ids]
    pos = torch.arange(start + len(block_ids))
    for i in range(cfg.num_hidden_layers):
        p = lambda name: sd[f"layers.{i}.{name}"]  # noqa: E731
        h = rms(x, p("input_layernorm.weight"))
        q = rms((h @ p("self_attn.q_proj.weight").T).view(-1, nh, hd), p("self_attn.q_norm.weight"))
        both = torch.cat([ctx, h])
        k = rms((both @ p("self_attn.k_proj.weight").T).view(-1, nkv, hd), p("self_attn.k_norm.weight"))
        v = (both @ p("self_attn.v_proj.weight").T).view(-1, nkv, hd)
        q, k = rotate(q, pos[start:], inv_freq), rotate(k, pos, inv_freq)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5  # no mask: every query sees everything
        out = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(len(block_ids), -1)
        x = x + out @ p("self_attn.o_proj.weight").T
        h = rms(x, p("post_attention_layernorm.weight"))
        x = x + (torch.nn.functional.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) \
            @ p("mlp.down_proj.weight").T
    return (rms(x, sd["norm.weight"]) @ lm_head.T)[1:]


def zlab_logits(path, features, block_ids, start, embed, lm_head):
    dflash_model = pytest.importorskip("dflash.model")
    ref = dflash_model.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = ref(position_ids=torch.arange(start + len(block_ids))[None], noise_embedding=embed[block_ids][None],
                     target_hidden=features[None])
    return (hidden[0] @ lm_head.T)[1:]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    hf = build_tiny_model("qwen3", root / "target", seed=7)
    build_random_drafter(root / "drafter", hf.config, seed=2, block_size=BLOCK, num_layers=2,
                         target_layer_ids=[0, 2])
    config = json.loads((root / "drafter" / "config.json").read_text())
    config["dflash_config"]["block_sizes"] = list(SHORT_BLOCKS) + [BLOCK]  # as if trained for them too
    (root / "drafter" / "config.json").write_text(json.dumps(config))
    return root, hf


def hf_features(hf, ids, layer_ids):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], -1)


@pytest.mark.parametrize("reference", ["dense", "zlab"])
def test_block_logits_match_reference(setup, reference):
    root, hf = setup
    target = tiny_target(root / "target", eos=())
    drafter = load_drafter(root / "drafter", target.model)
    # steps in order: after the prefill step the first tokens are committed and the drafter's context written
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=256, page_size=4, overlap_steps=False),
                    drafter)
    sd = {k: v.float() for k, v in load_dflash(root / "drafter", torch.device("cpu"), torch.float32).state_dict().items()}
    cfg = read_dflash_config(root / "drafter")
    embed, lm_head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()

    # a step scoring fewer drafts runs the shortest declared block that holds them (`DFlashSpec.block_for`)
    # (a draft of 1, a chain of 2, from the block of 3: the shortest that holds the anchor and its mask)
    blocks = {n: drafter.block_rows(n) for n in drafter.draft_lengths}
    assert blocks == {1: 3, 4: 5}

    def check(requests):
        drafted = {BLOCK - 1: drafter.draft_logits(requests)}
        for n in (1,):  # from the same context, written by the first step
            drafted[n] = drafter._step(requests, eager=True, length=n)
        for i, request in enumerate(requests):
            committed = request.all_ids[:-1]
            feats = hf_features(hf, committed, drafter.target_layer_ids)
            for n, logits in drafted.items():
                block = torch.tensor([request.pending_token] + [drafter.mask_token_id] * (blocks[n] - 1))
                if reference == "dense":
                    want = dense_dflash_logits(sd, cfg, feats, block, len(committed), embed, lm_head)
                else:
                    want = zlab_logits(root / "drafter", feats, block, len(committed), embed, lm_head)
                torch.testing.assert_close(logits[i], want[:n], atol=2e-4, rtol=2e-4)

    requests = [engine.add_request(p, SamplingParams(max_new_tokens=40)) for p in PROMPTS]
    engine.step()  # the prefill (every prompt fits the step's budget); then driven by hand, step by step
    assert all(r.decoding for r in requests)
    check(requests)  # first step: the whole prompt is new context
    # a few real steps with partial acceptance, then the context comes from the paged cache
    hf_cont = {}
    for p in PROMPTS:
        out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40, eos_token_id=[], pad_token_id=0)
        hf_cont[tuple(p)] = out[0, len(p):].tolist()
    scripted = ScriptedDrafter(hf_cont, BLOCK, VOCAB, error_rate=0.3, seed=1)
    scripted.attach(engine)
    real_propose = drafter.propose
    drafter.propose = lambda reqs, length=None: (real_propose(reqs), scripted.propose(reqs))[1]  # cache in step
    for _ in range(3):
        engine._decode(requests, lambda r, t: None)
    drafter.propose = real_propose
    check(requests)


def test_checkpoint_round_trip(setup, tmp_path):
    root, _ = setup
    model = load_dflash(root / "drafter", torch.device("cpu"), torch.float32)
    save_dflash(model, tmp_path / "copy", dtype=torch.float32)
    again = load_dflash(tmp_path / "copy", torch.device("cpu"), torch.float32)
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    assert again.spec == model.spec
    names = set(model.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight",
            "layers.1.mlp.down_proj.weight", "layers.1.post_attention_layernorm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_one_context_row_per_request_is_staged_where_a_layout_over_the_pages_puts_it():
    """A plain step writes one context row per request: its position and K/V slot, read from each table alone, are
    those of the layout the other writes build over every table's pages (page boundaries crossed included)."""
    from types import SimpleNamespace

    from attention.batch_layout import BatchLayout
    from attention.page_pool import PagePool, PageTable
    from drafters.dflash import DFlashDrafter

    lengths = (1, 3, 4, 5, 8, 11)  # 4 and 8 fill their last page: the next row takes a new one

    def tables():
        pool = PagePool(64, 4)
        grown = [PageTable(pool) for _ in lengths]
        for table, n in zip(grown, lengths):
            table.grow(n)
        return grown

    staged = {}
    stub = SimpleNamespace(page_size=4, context_step="context",
                           stage_token_places=lambda step, *places: staged.update(places=places) or len(places[0]))
    assert DFlashDrafter._stage_one_position_each(stub, tables()) == len(lengths)
    reference = tables()
    for table in reference:
        table.grow(1)
    want = BatchLayout.for_tokens([1] * len(lengths), [t.length for t in reference], [t.array for t in reference], 4,
                                  causal=False).new_kv_places()
    assert [list(map(int, got)) for got in staged["places"]] == [w.tolist() for w in want]

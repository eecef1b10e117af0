"""Drafter training: anchors and the training mask, the dense training forward against the
inference drafter, learning, resume, export (bf16 and fp8 storage) and data shards."""

import copy
import json
import re
from types import SimpleNamespace

import pytest
import torch

from drafters import load_drafter
from drafters.dflash_model import WEIGHTS_FILE, load_dflash, read_dflash_config, save_dflash
from drafters.training.anchors import (
    IGNORE,
    Anchors,
    acceptance_lengths,
    anchor_candidates,
    block_input_ids,
    block_labels,
    decoding_walk,
    first_anchors,
    sample_anchors,
    sample_block_sizes,
)
from drafters.training.checkpoint import drafter_from_checkpoint, load_checkpoint
from drafters.training.data import TokenSamples, heldout_key, load_samples, shard_metadata, shard_path
from drafters.training.forward import LinearCrossEntropy, block_hidden
from drafters.training.generation import GenerationSettings, generate_shards, next_shard_fits
from drafters.training.mask import training_mask
from drafters.training.target import check_mask_token
from specdec.engine.config import EngineConfig
from specdec.engine.engine import Engine
from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB
from tests.engine_helpers import tiny_engine, tiny_target
from tests.training_helpers import BLOCK, MASK, batch_of, frozen_target, make_trainer, toy_data_dir


def test_training_mask_on_a_hand_example():
    mask = training_mask(torch.tensor([[2, 5]]), context_len=7, block_size=3)[0, 0]
    ctx, blocks = mask[:, :7].int(), mask[:, 7:].int()
    # block 0 (anchor 2) sees context 0..1, block 1 (anchor 5) sees context 0..4: strictly before the anchor
    assert ctx.tolist() == [[1, 1, 0, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0, 0]] * 3
    # each block sees all of its own tokens (non-causal) and nothing of the other block
    assert blocks.tolist() == [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3


def test_a_shorter_blocks_tokens_see_only_its_first_tokens():
    """Block sizes drawn per block: block 0 of size 2 is a block of 2 at inference (its third row sees what the
    others see, and has no label); block 1 keeps its whole 3."""
    mask = training_mask(torch.tensor([[2, 5]]), context_len=7, block_size=3, block_sizes=torch.tensor([[2, 3]]))[0, 0]
    ctx, blocks = mask[:, :7].int(), mask[:, 7:].int()
    assert ctx.tolist() == [[1, 1, 0, 0, 0, 0, 0]] * 3 + [[1, 1, 1, 1, 1, 0, 0]] * 3
    assert blocks.tolist() == [[1, 1, 0, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3
    batch = batch_of([list(range(10, 20))], [4])
    anchors = Anchors(torch.tensor([[4, 6]]), torch.tensor([[True, True]]), torch.tensor([[2, 4]]))
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, anchors, block_size=4, gamma=2.0)
    assert labels[0].tolist() == [[IGNORE, 15, IGNORE, IGNORE], [IGNORE, 17, 18, 19]]
    assert (weights == 0).eq(labels == IGNORE).all()
    drawn = sample_block_sizes(sample_anchors(batch.loss_mask, 6, torch.Generator().manual_seed(0)), (2, 4),
                               torch.Generator().manual_seed(1))
    assert set(drawn.block_sizes.flatten().tolist()) == {2, 4}


def test_labels_weights_and_block_inputs():
    # positions 0..3 prompt, 4..9 response; a second, shorter sequence padded on the right
    batch = batch_of([list(range(10, 20)), list(range(30, 37))], [4, 3])
    anchors = Anchors(torch.tensor([[4, 7], [5, 0]]), torch.tensor([[True, True], [True, False]]))
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, anchors, block_size=4, gamma=2.0)
    assert labels[0, 0].tolist() == [IGNORE, 15, 16, 17]
    assert labels[0, 1].tolist() == [IGNORE, 18, 19, IGNORE]  # position 10 is past the sequence
    assert labels[1, 0].tolist() == [IGNORE, 36, IGNORE, IGNORE]  # 7 and 8 are padding
    assert labels[1, 1].tolist() == [IGNORE] * 4  # padding anchor
    w = torch.exp(-torch.arange(3) / 2.0)
    torch.testing.assert_close(weights[0, 0], torch.cat([torch.zeros(1), w]))
    torch.testing.assert_close(weights[0, 1], torch.tensor([0.0, w[0], w[1], 0.0]))
    assert (weights == 0).eq(labels == IGNORE).all()
    block = block_input_ids(batch.input_ids, anchors, 4, MASK)
    assert block[0].tolist() == [[14, MASK, MASK, MASK], [17, MASK, MASK, MASK]]


def test_anchors_only_where_this_and_next_position_are_response():
    loss_mask = torch.zeros(3, 12, dtype=torch.bool)
    loss_mask[0, 5:12] = True  # candidates 5..10
    loss_mask[1, 2:5] = True  # candidates 2..3
    loss_mask[1, 7:8] = True  # a lone response position is no anchor
    cand = anchor_candidates(loss_mask)
    assert torch.nonzero(cand[0]).flatten().tolist() == list(range(5, 11))
    assert torch.nonzero(cand[1]).flatten().tolist() == [2, 3]
    assert not cand[2].any()
    for seed in range(5):
        a = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(seed))
        assert a.positions.shape == (3, 4)
        assert a.valid.sum(1).tolist() == [4, 2, 0]
        for row in range(3):
            picked = a.positions[row][a.valid[row]].tolist()
            assert picked == sorted(set(picked)) and all(cand[row, t] for t in picked)


def test_acceptance_length_counts_the_accepted_prefix_plus_bonus():
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert acceptance_lengths(correct).tolist() == [3, 1, 5]


def test_chunked_cross_entropy_matches_autograd():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=g, requires_grad=True)
    weight, labels = torch.randn(20, 8, generator=g), torch.randint(0, 20, (13,), generator=g)
    w = torch.rand(13, generator=g)
    total, correct = LinearCrossEntropy.apply(hidden, weight, None, labels, w, 1.5, 4)
    (2 * total).backward()
    ref_h = hidden.detach().clone().requires_grad_(True)
    logits = ref_h @ weight.T * 1.5
    ref = (torch.nn.functional.cross_entropy(logits, labels, reduction="none") * w).sum()
    (2 * ref).backward()
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(hidden.grad, ref_h.grad)
    assert correct.tolist() == (logits.argmax(-1) == labels).tolist()


def test_mask_token_must_be_unused():
    check_mask_token(151669, 151936)
    with pytest.raises(ValueError, match="outside"):
        check_mask_token(151936, 151936)

    class Tok:
        def __len__(self):
            return 151936

        def convert_ids_to_tokens(self, i):
            return f"[PAD{i}]" if i >= 151665 else "hello"

    check_mask_token(151669, 151936, Tok())  # GGUF placeholder row: unused
    with pytest.raises(ValueError, match="real token"):
        check_mask_token(151000, 151936, Tok())


# ---- (b) training forward == inference drafter --------------------------------------------------
def test_training_forward_matches_inference_drafter(setup):
    """Several anchors in two padded sequences, one forward: each block's logits equal the paged
    inference drafter's for a request whose committed context is the prefix before that anchor."""
    root, hf, drafter = setup
    save_dflash(drafter, root / "fp32", dtype=torch.float32)
    sequences = []
    for prompt in ([5, 17, 33, 9, 11, 40, 41], [7, 8, 9]):
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=[], pad_token_id=0)
        sequences.append(out[0].tolist())  # greedy, so each prefix's first token is the next one of the sequence
    anchors = [[7, 10, 14], [3, 6, 9]]

    target = tiny_target(root / "target", eos=())
    paged = load_drafter(root / "fp32", target.model)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=256, page_size=4, overlap_steps=False), paged)
    requests = [engine.add_request(s[:a], SamplingParams(max_new_tokens=40)) for s, row in zip(sequences, anchors)
                for a in row]
    engine.step()  # the prefill: every prompt fits one step's budget
    assert [r.pending_token for r in requests] == [s[a] for s, row in zip(sequences, anchors) for a in row]
    want = paged.draft_logits(requests)

    frozen = frozen_target(root)
    batch = batch_of(sequences, [7, 3])
    anchor_set = Anchors(torch.tensor(anchors), torch.ones(2, 3, dtype=torch.bool))
    embeds = frozen.embed(block_input_ids(batch.input_ids, anchor_set, BLOCK, MASK))
    with torch.no_grad():
        hidden = block_hidden(drafter, frozen.features(batch.input_ids), embeds, anchor_set.positions)
        got = drafter.block_logits(hidden[:, :, 1:], frozen.lm_head).reshape(want.shape)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_training_forward_of_short_blocks_matches_the_inference_drafters_short_blocks(setup):
    """Trained for blocks of 3 as well (the whole block is BLOCK), the drafter declares them, and the paged
    drafter's step scoring 1 draft (a chain of 2) runs a block of 3: its logits are the training forward's for
    blocks of size 3, whose other rows do not change them."""
    root, hf, drafter = setup
    drafter = copy.deepcopy(drafter)  # the module's drafter stays trained for whole blocks alone
    drafter.config.dflash_config = {**drafter.config.dflash_config, "block_sizes": [3, BLOCK]}
    save_dflash(drafter, root / "short-blocks", dtype=torch.float32)
    sequence = hf.generate(torch.tensor([[5, 17, 33, 9, 11, 40, 41]]), do_sample=False, max_new_tokens=12,
                           eos_token_id=[], pad_token_id=0)[0].tolist()
    anchors = [7, 10, 14]

    target = tiny_target(root / "target", eos=())
    paged = load_drafter(root / "short-blocks", target.model)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=256, page_size=4, verify="auto",
                                         overlap_steps=False), paged)
    requests = [engine.add_request(sequence[:a], SamplingParams(max_new_tokens=40)) for a in anchors]
    engine.step()
    assert paged.block_rows(1) == 3
    want = paged._step(requests, eager=True, length=1)  # [3, 1, vocab]

    frozen = frozen_target(root)
    batch = batch_of([sequence], [7])
    anchor_set = Anchors(torch.tensor([anchors]), torch.ones(1, 3, dtype=torch.bool), torch.full((1, 3), 3))
    embeds = frozen.embed(block_input_ids(batch.input_ids, anchor_set, BLOCK, MASK))
    with torch.no_grad():
        hidden = block_hidden(drafter, frozen.features(batch.input_ids), embeds, anchor_set.positions,
                              anchor_set.block_sizes)
        got = drafter.block_logits(hidden[0, :, 1:2], frozen.lm_head)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_trainer_of_shorter_blocks_declares_them(setup, tmp_path):
    root, _, drafter = setup
    trainer = make_trainer(root, tmp_path, drafter.state_dict(), block_sizes=(2, 3), max_steps=2, eval_every=2)
    assert trainer.model.config.dflash_config["block_sizes"] == [2, 3, BLOCK]
    assert len(trainer.train(progress=False)) == 2
    with pytest.raises(ValueError, match="block sizes to train"):
        make_trainer(root, tmp_path / "bad", drafter.state_dict(), block_sizes=(1,))


# ---- (c) learning, (d) resume ----------------------------------------------------------------
def test_training_lowers_the_loss(setup, tmp_path):
    root, hf, drafter = setup
    trainer = make_trainer(root, tmp_path, drafter.state_dict())
    losses = trainer.train(progress=False)
    assert len(losses) == 20 and trainer.step == 20
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20]
    assert all(r["tau_estimate"] is not None and 1 <= r["tau_estimate"] <= BLOCK for r in log)
    assert load_checkpoint(tmp_path)["step"] == 20


def flat(record: dict, prefix: str = "") -> dict:
    """A log record with its nested per-domain numbers as dotted keys."""
    out = {}
    for key, value in record.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def test_resume_continues_exactly(setup, tmp_path):
    root, _, drafter = setup
    state = drafter.state_dict()
    straight = make_trainer(root, tmp_path / "straight", state, max_steps=8, eval_every=4)
    straight_losses = straight.train(progress=False)
    first = make_trainer(root, tmp_path / "split", state, max_steps=8, eval_every=4)
    head = first.train(until_step=3, progress=False)  # stopped between two log lines
    second = make_trainer(root, tmp_path / "split", state, max_steps=8, eval_every=4)
    assert second.resume() and second.step == 3
    tail = second.train(progress=False)
    torch.testing.assert_close(torch.tensor(head + tail), torch.tensor(straight_losses), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(straight.model.state_dict().items(), second.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # a call whose time budget is already spent takes no step but still leaves a checkpoint
    late = make_trainer(root, tmp_path / "late", state, max_steps=8, time_budget_s=1.0)
    late.start_time -= 2.0
    assert late.train(progress=False) == [] and load_checkpoint(tmp_path / "late")["step"] == 0
    logs = [[{k: v for k, v in flat(json.loads(line)).items() if k != "elapsed_s"}
             for line in (tmp_path / run / "log.jsonl").read_text().splitlines()] for run in ("straight", "split")]
    assert [r["step"] for r in logs[0]] == [4, 8]
    for a, b in zip(*logs):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-5) for k in a)


def test_time_budget_does_not_extrapolate_the_warm_up_step(setup, tmp_path, monkeypatch):
    """The budget reserves room for the next step from the steps' cost, not from a call's first step,
    which warms up (kernel builds) and can take many times longer: a run whose steps fit finishes, with
    its final held-out line."""
    import drafters.training.trainer as trainer_module

    root, _, drafter = setup
    clock = [0.0]
    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    trainer = make_trainer(root, tmp_path, drafter.state_dict(), max_steps=5, eval_every=1000, time_budget_s=120.0)
    step = trainer.train_step

    def timed_step(batch):  # the first step takes 100 s, the others 1 s
        clock[0] += 100.0 if trainer.step == 0 else 1.0
        return step(batch)

    monkeypatch.setattr(trainer, "train_step", timed_step)
    assert len(trainer.train(progress=False)) == 5 and trainer.step == 5
    assert [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == [5]


# ---- (e) export -------------------------------------------------------------------------------
def test_export_bf16_and_fp8(setup, tmp_path):
    root, hf, drafter = setup
    trainer = make_trainer(root, tmp_path / "run", drafter.state_dict(), max_steps=1)
    trainer.train(progress=False)
    from scripts.export_drafter import export

    export(str(tmp_path / "run"), str(tmp_path / "bf16"))
    export(str(tmp_path / "run"), str(tmp_path / "fp8"), storage="fp8")
    trained = drafter_from_checkpoint(tmp_path / "run")
    rounded = {k: v.to(torch.bfloat16).float() for k, v in trained.state_dict().items()}

    # bf16: our loader reads it, weights are the bf16 rounding, and its paged logits match training's forward
    bf16 = load_dflash(tmp_path / "bf16", torch.device("cpu"), torch.float32)
    assert bf16.spec.draft_window == trainer.config.max_length  # it declares how far back it was trained to attend
    for k, v in bf16.state_dict().items():
        assert torch.equal(v, rounded[k]), k
    target = tiny_target(root / "target", eos=())
    paged = load_drafter(tmp_path / "bf16", target.model)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4, overlap_steps=False), paged)
    prompt = [5, 17, 33, 9, 11, 40, 41, 12]
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    engine.step()  # the prefill
    want = paged.draft_logits([request])[0]
    frozen = frozen_target(root)
    seq = torch.tensor([prompt + [request.pending_token]])
    anchors = Anchors(torch.tensor([[len(prompt)]]), torch.ones(1, 1, dtype=torch.bool))
    with torch.no_grad():
        hidden = block_hidden(bf16, frozen.features(seq), frozen.embed(block_input_ids(seq, anchors, BLOCK, MASK)),
                              anchors.positions)
        torch.testing.assert_close(bf16.block_logits(hidden[0, 0, 1:], frozen.lm_head), want, atol=1e-4, rtol=1e-4)

    # z-lab's package reads the bf16 export
    dflash_model = pytest.importorskip("dflash.model")
    ref = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    block = block_input_ids(seq, anchors, BLOCK, MASK)[0, 0]
    with torch.no_grad():
        zlab = ref(position_ids=torch.arange(len(prompt) + BLOCK)[None], noise_embedding=frozen.embed(block)[None],
                   target_hidden=frozen.features(seq)[:, :len(prompt)])
    torch.testing.assert_close(zlab[0, 1:] @ frozen.lm_head.weight.T, want, atol=1e-4, rtol=1e-4)

    # fp8: dequantized at load to within e4m3 rounding, norms exact in bf16, a smaller file
    assert read_dflash_config(tmp_path / "fp8").weight_storage == "fp8_e4m3_per_channel"
    assert "weight_storage" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    fp8 = load_dflash(tmp_path / "fp8", torch.device("cpu"), torch.float32)
    for k, v in fp8.state_dict().items():
        w = trained.state_dict()[k]
        if w.dim() < 2:
            assert torch.equal(v, rounded[k]), k
            continue
        scale = w.abs().amax(1, keepdim=True) / 448
        err = (v - w).abs()
        assert (err <= w.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-12).all(), k  # e4m3: 3 mantissa bits
        assert (err / w.abs().clamp(min=1e-12)).mean() < 0.03, k
    size = lambda d: (tmp_path / d / WEIGHTS_FILE).stat().st_size  # noqa: E731
    assert size("fp8") < 0.65 * size("bf16")
    load_drafter(tmp_path / "fp8", target.model)  # the engine's loader accepts it

    # a stored drafter re-exported for the peers (fp8 -> bf16): exactly the bf16 weights the engine loads
    export(str(tmp_path / "fp8"), str(tmp_path / "fp8-as-bf16"))
    assert "weight_storage" not in json.loads((tmp_path / "fp8-as-bf16" / "config.json").read_text())
    engine_weights = load_dflash(tmp_path / "fp8", torch.device("cpu"), torch.bfloat16).state_dict()
    for k, v in load_dflash(tmp_path / "fp8-as-bf16", torch.device("cpu"), torch.bfloat16).state_dict().items():
        assert torch.equal(v, engine_weights[k]), k


def test_train_script_starts_from_an_exported_drafter(setup, tmp_path):
    """--init-from: a new run whose step-0 checkpoint holds the exported (fp8-dequantized) weights."""
    root, hf, drafter = setup
    save_dflash(drafter, tmp_path / "shipped", storage="fp8")
    data = toy_data_dir(tmp_path / "data")
    from scripts.train_drafter import main

    main(["--data", str(data), "--out", str(tmp_path / "run"), "--target", str(root / "target"),
          "--init-from", str(tmp_path / "shipped"), "--device", "cpu", "--mask-token-id", str(MASK),
          "--max-steps", "5", "--eval-fraction", "0.2", "--time-budget-s", "0"])  # spent: saves step 0, no step
    assert load_checkpoint(tmp_path / "run")["step"] == 0
    started = drafter_from_checkpoint(tmp_path / "run").state_dict()
    shipped = load_dflash(tmp_path / "shipped", torch.device("cpu"), torch.float32).state_dict()
    assert started.keys() == shipped.keys()
    for k, v in shipped.items():
        assert torch.equal(started[k], v), k
    assert any(not torch.equal(v, drafter.state_dict()[k]) for k, v in shipped.items())  # fp8 rounding is visible

    # a drafter made for another target is refused before any work, naming both values
    config_file = tmp_path / "shipped" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_target_layers": 28}))
    with pytest.raises(ValueError, match=f"num_target_layers 28 != the target's {hf.config.num_hidden_layers} layers"):
        main(["--data", str(data), "--out", str(tmp_path / "other"), "--target", str(root / "target"),
              "--init-from", str(tmp_path / "shipped"), "--device", "cpu", "--eval-fraction", "0.2",
              "--time-budget-s", "0"])


def test_train_script_repeats_a_domain_of_the_training_split_only(setup, tmp_path, capsys):
    root, _, _ = setup
    data = toy_data_dir(tmp_path / "data")
    from scripts.train_drafter import main

    def data_line(*extra):
        main(["--data", str(data), "--out", str(tmp_path / f"run{len(extra)}"), "--target", str(root / "target"),
              "--device", "cpu", "--mask-token-id", str(MASK), "--eval-fraction", "0.5", "--time-budget-s", "0",
              *extra])
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data:"))

    plain, doubled = data_line(), data_line("--domain-repeats", "math=2")
    trained, held = map(int, re.match(r"data: (\d+) training sequences, (\d+) held out", plain).groups())
    assert trained > 0 and held > 0
    assert doubled.startswith(f"data: {2 * trained} training sequences, {held} held out")
    with pytest.raises(ValueError, match="no samples of domain code to repeat; the data holds math"):
        data_line("--domain-repeats", "code=2")
    with pytest.raises(SystemExit):
        data_line("--domain-repeats", "math")
    assert "expected DOMAIN=N" in capsys.readouterr().err


# ---- (f) data shards ----------------------------------------------------------------------------
def build_word_tokenizer(path):
    """A WordLevel tokenizer over the tiny vocabulary with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "<user>", "</user>", "<assistant>"]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<user> {{ m['content'] }} </user> {% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    fast.save_pretrained(path)
    return fast


def test_data_shards_generate_load_and_resume(setup, tmp_path, monkeypatch):
    root, hf, _ = setup
    build_word_tokenizer(root / "target")
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"w{10 + i} w{20 + i} w3{i}"}) + "\n" for i in range(3)))
    from scripts.generate_training_data import main

    args = ["--out", str(tmp_path / "data"), "--target", str(root / "target"), "--problems", str(problems),
            "--source", "math:all", "--shard-size", "2", "--max-new-tokens", "6", "--samples-per-problem", "1", "--temperature", "1.0",
            "--device", "cpu", "--num-kv-pages", "64", "--batch-size", "8"]
    main(args)
    files = sorted((tmp_path / "data").glob("shard-*.safetensors"))
    assert [f.name for f in files] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    samples = load_samples(tmp_path / "data")
    assert len(samples) == 6 and samples.problem_ids.tolist() == [0, 0, 1, 1, 2, 2]
    first_shard = shard_metadata(files[0])  # its throughput is on record: response tokens and seconds
    assert first_shard["generated_tokens"] == int((samples.lengths - samples.prompt_lens.long())[:4].sum())
    assert first_shard["seconds"] >= 0
    assert samples.tokens.dtype == torch.int32
    ids, prompt_len = samples[0]
    assert ids[prompt_len - 1].item() == 6  # the prompt ends with the generation prompt <assistant>
    want = hf.generate(ids[None, :prompt_len], do_sample=False, max_new_tokens=6, eos_token_id=2, pad_token_id=0)
    assert ids.tolist() == want[0].tolist()  # sample 0 is the greedy answer
    assert 1 <= len(ids) - prompt_len <= 6
    keys = sorted(heldout_key(samples.prompt_ids(i), 0) for i in (0, 2, 4))  # one per problem
    train, held = samples.split_held_out((keys[0] + keys[1]) / 2)  # the first problem's answers, both
    assert len(held) == 2 and len(set(held.problem_ids.tolist())) == 1 and len(train) == 4

    # a second run skips the finished shards; a partly covered range is redone when extended
    stamps = [f.stat().st_mtime_ns for f in files]
    monkeypatch.setattr(Engine, "add_request", lambda *a, **k: pytest.fail("finished shards must be skipped"))
    main(args)
    assert [f.stat().st_mtime_ns for f in files] == stamps
    monkeypatch.undo()
    part = tmp_path / "part"
    target = tiny_target(root / "target")
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4))
    prompts = [samples[i][0][:samples[i][1]].tolist() for i in (0, 2, 4)]
    settings = GenerationSettings(max_new_tokens=4, shard_size=2)
    generate_shards(engine, prompts, part, settings, limit=1, progress=False)
    assert len(load_samples(part)) == 1
    generate_shards(engine, prompts, part, settings, progress=False)
    assert load_samples(part).problem_ids.tolist() == [0, 1, 2]


def test_samples_load_from_several_directories(tmp_path):
    """Data generated from different prompt lists trains together: every directory's shards, in order,
    with the domains matched by name (each list numbers its domains its own way); a directory without
    shards is an error, not silently less data."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    TokenSamples.from_lists([([1, 2], [3], 0), ([4], [5, 6], 1)], ["math", "libcode"]).save(shard_path(first, 0))
    TokenSamples.from_lists([([7], [8], 0)], ["math"]).save(shard_path(first, 1))
    TokenSamples.from_lists([([9], [10, 11], 0), ([12], [13], 1)], ["libcode", "general"]).save(shard_path(second, 0))
    samples = load_samples(first, second)
    assert [samples[i][0].tolist() for i in range(len(samples))] == [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11], [12, 13]]
    assert [samples.domains[d] for d in samples.domain_ids.tolist()] == ["math", "libcode", "math", "libcode", "general"]
    assert samples.prompt_lens.tolist() == [2, 1, 1, 1, 1]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_samples(first, tmp_path / "empty")


def test_shards_are_pipelined_and_a_failure_gives_every_page_back(setup, tmp_path, monkeypatch):
    """The next shard's requests join while the current one's decode (the batch never drains between
    shards), each shard holds the answers its prompts get alone, and a failure mid-run aborts every
    request in flight with all pages back."""
    root, _, _ = setup
    target = tiny_target(root / "target")
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=64, page_size=4, max_num_seqs=3))
    prompts = [[5 + i, 6 + 2 * i, 7] for i in range(6)]
    settings = GenerationSettings(max_new_tokens=5, shard_size=2)
    shards_per_step, step = [], Engine.step

    def recording_step(self, on_commit=None):
        out = step(self, on_commit)
        shards_per_step.append(len({prompts.index(r.prompt_ids) // 2 for r in self.scheduler.running}))
        return out

    monkeypatch.setattr(Engine, "step", recording_step)
    files = generate_shards(engine, prompts, tmp_path / "data", settings, progress=False)
    monkeypatch.undo()
    assert len(files) == 3 and max(shards_per_step) >= 2
    samples = load_samples(tmp_path / "data")
    alone = engine.generate_ids(prompts, SamplingParams(max_new_tokens=5))
    assert [samples[i][0][samples[i][1]:].tolist() for i in range(6)] == [r.output_ids for r in alone]

    calls = []

    def failing_step(self, on_commit=None):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("boom")
        return step(self, on_commit)

    monkeypatch.setattr(Engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        generate_shards(engine, prompts, tmp_path / "failing", settings, progress=False)
    assert engine.pool.num_free == engine.pool.num_pages and not engine.has_unfinished_requests
    assert not list((tmp_path / "failing").glob("shard-*"))  # no shard had finished


def test_decoding_walk_and_first_anchors_on_a_hand_example():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    anchors = first_anchors(mask, 3)  # the first 3 candidates of each row, in order (row 1 has 2)
    assert anchors.positions.tolist() == [[2, 3, 4], [1, 2, 0]] and anchors.valid.tolist() == [[1, 1, 1], [1, 1, 0]]
    # block i starts where block i-1's accepted drafts and bonus end
    assert decoding_walk(torch.tensor([2, 1, 3, 1, 1, 4]), torch.tensor([1, 1, 1, 1, 1, 0]).bool()) == [2, 3]


def test_held_out_decoding_estimate_is_what_decoding_measures(setup, tmp_path):
    """The trainer's decode_tau_estimate replays greedy decoding over teacher-forced acceptances: on the
    engine's own outputs it gives, step for step, the acceptance lengths the engine measured."""
    root, hf, drafter = setup
    target = tiny_target(root / "target", eos=())
    prompts = [[5, 17, 33, 9], [7, 8, 9, 10, 11], [60, 61, 62]]
    answers = tiny_engine(root / "target", eos=()).generate_ids(prompts, SamplingParams(max_new_tokens=40))
    trainer = make_trainer(root, tmp_path / "fit", drafter.state_dict(), max_steps=10, eval_every=1000,
                           anchors_per_seq=32)  # a drafter that gets some blocks right on these answers
    trainer.train_data = TokenSamples.from_lists([(p, a.output_ids, i) for i, (p, a) in enumerate(zip(prompts, answers))])
    trainer.train(progress=False)
    save_dflash(trainer.model, tmp_path / "fitted", dtype=torch.float32)
    engine = Engine(target, EngineConfig(device="cpu", num_kv_pages=256, page_size=4),
                    load_drafter(tmp_path / "fitted", target.model))
    spec = engine.generate_ids(prompts, SamplingParams(max_new_tokens=40))
    assert [r.output_ids for r in spec] == [a.output_ids for a in answers]
    measured = [r.stats.acceptance_lengths for r in spec]
    assert max(max(m) for m in measured) >= 3  # the test means something only if blocks get accepted

    trainer.model.eval()
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        one = TokenSamples.from_lists([(prompt, answer.output_ids, 0)])
        with torch.no_grad():
            result, anchors = trainer.batch_loss(one, [0], lambda mask: first_anchors(mask, 64))
        walk = decoding_walk(acceptance_lengths(result.correct)[0], anchors.valid[0])
        # the engine's first token comes from the prefill and its last step is cut at max_new_tokens
        assert walk[:-1] == measured[i][:len(walk) - 1], (walk, measured[i])
    assert 1.0 <= trainer.held_out_score(trainer.train_data).summary()["decode_tau_estimate"] <= BLOCK


def test_a_shard_is_started_when_throughput_says_it_fits():
    """Shards overlap: with the first shard done after 62 s and two more 80% done, throughput is a
    shard per ~22 s, so one more (after the in-flight remainder) fits in 170 s; the first shard's
    latency times the shards outstanding (3 x 62 s) would have said no."""
    assert next_shard_fits(62, 0, [0.9, 0.5], 1)  # nothing finished yet: nothing to judge by
    assert next_shard_fits(62, 1, [0.8, 0.8], 170)
    assert not next_shard_fits(62, 1, [0.8, 0.8], 30)
    assert not next_shard_fits(100, 1, [], 110)  # 100 s a shard, 20% margin: 120 s needed
    assert next_shard_fits(100, 1, [], 120)

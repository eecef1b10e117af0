"""Quantization-aware training (drafters.training.quant_aware): the fake quantization is exactly what the
stored drafter holds, gradients pass straight through, and a drafter trained this way and exported in
its storage computes what it computed in training."""

import copy
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from drafters.dflash_model import load_dflash, save_dflash
from drafters.training.anchors import block_labels
from drafters.training.checkpoint import drafter_from_checkpoint, load_checkpoint
from drafters.training.forward import block_loss
from drafters.training.quant_aware import QuantAwareLinear, fake_quantize, make_quant_aware
from drafters.weight_storage import FP8, dequantize, quantize
from tests.training_helpers import BLOCK, block_logits_of, toy_data_dir


def awkward_weights(seed=0) -> torch.Tensor:
    """Rows of 64 (two blocks each) at several magnitudes, plus blocks that are all zero, hold a +/- tie
    for the largest magnitude, or have a single nonzero weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(12, 64, generator=g) * torch.logspace(-4, 1, 12)[:, None]
    w[0, :32] = 0.0
    w[1, :32] = torch.linspace(-1, 1, 32)  # -1 and +1: a tie, the first one wins
    w[2, 32:] = 0.0
    w[2, 40] = -3.0
    return w


@pytest.mark.parametrize("storage", ["q8_0", "q5_0", "q4_0"])
def test_fake_quantization_is_gguf_round_trip(storage):
    w = awkward_weights()
    kind = GGMLQuantizationType[storage.upper()]
    want = quants.dequantize(quants.quantize(w.numpy(), kind), kind)
    got = fake_quantize(w, storage)
    assert np.array_equal(got.numpy(), want)
    assert not torch.equal(got, w)
    # storing the fake-quantized weights again changes nothing: what training saw is what ships
    assert np.array_equal(quants.dequantize(quants.quantize(got.numpy(), kind), kind), want)


def test_fp8_fake_quantization_is_the_fp8_storage():
    w = awkward_weights(1)
    stored = dequantize(quantize({"w": w}, {"w"}, "fp8"), FP8, "test")["w"]
    assert torch.equal(fake_quantize(w, "fp8"), stored)


def test_fake_quantization_refusals():
    with pytest.raises(ValueError, match="supports fp8, q8_0, q5_0, q4_0, not 'q4_1'"):
        fake_quantize(torch.zeros(2, 32), "q4_1")
    with pytest.raises(ValueError, match="rows of 48 weights cannot be stored as q4_0"):
        fake_quantize(torch.zeros(2, 48), "q4_0")


def test_quant_aware_drafter_trains_straight_through_and_exports_what_it_computed(setup, tmp_path):
    root, hf, drafter = setup
    drafter = copy.deepcopy(drafter)
    with torch.no_grad():  # every storage keeps the norms in bf16; QAT is about the Linear weights
        for p in drafter.parameters():
            if p.dim() < 2:
                p.copy_(p.to(torch.bfloat16).float())
    aware = make_quant_aware(copy.deepcopy(drafter), "q4_0")
    assert aware.state_dict().keys() == drafter.state_dict().keys()  # checkpoints and export unchanged
    assert isinstance(aware.fc, QuantAwareLinear) and isinstance(aware.layers[1].mlp.down_proj, QuantAwareLinear)
    # the same computation as a plain drafter holding the quantized weights ...
    snapped = copy.deepcopy(drafter)
    with torch.no_grad():
        for name, module in snapped.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(fake_quantize(module.weight, "q4_0"))
    sequences, anchors = [list(range(10, 30)), list(range(40, 60))], [[4, 9, 13], [5, 6, 12]]
    got, (frozen, batch, anchor_set, hidden) = block_logits_of(aware, root, sequences, anchors)
    want, (_, _, _, snapped_hidden) = block_logits_of(snapped, root, sequences, anchors)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # ... whose weight gradients the master weights receive unchanged (straight-through)
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, anchor_set, BLOCK, 4.0)
    block_loss(aware, hidden, frozen.lm_head, labels, weights).loss.backward()
    block_loss(snapped, snapped_hidden, frozen.lm_head, labels, weights).loss.backward()
    for (name, p), q in zip(aware.named_parameters(), snapped.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    # exported as q4_0 (from the master weights), the drafter computes exactly what training computed
    save_dflash(aware, tmp_path / "q4", dtype=torch.float32, storage="q4_0")
    stored, _ = block_logits_of(load_dflash(tmp_path / "q4", torch.device("cpu"), torch.float32), root,
                                sequences, anchors)
    torch.testing.assert_close(stored, got.detach(), atol=1e-6, rtol=1e-6)


def test_quant_aware_training_through_the_train_script(setup, tmp_path):
    root, hf, drafter = setup
    save_dflash(drafter, tmp_path / "start", dtype=torch.float32)
    data = toy_data_dir(tmp_path / "data")
    from scripts.train_drafter import main

    args = ["--data", str(data), "--out", str(tmp_path / "run"), "--target", str(root / "target"), "--device", "cpu",
            "--init-from", str(tmp_path / "start"), "--max-steps", "3", "--eval-every", "3", "--eval-fraction", "0.2",
            "--quant-aware", "q4_0"]
    main(args)
    state = load_checkpoint(tmp_path / "run")
    assert json.loads(state["train_config"])["quant_aware"] == "q4_0"
    trained = drafter_from_checkpoint(tmp_path / "run")
    assert not torch.equal(trained.fc.weight, drafter.fc.weight)  # the master weights learned
    with pytest.raises(SystemExit):  # argparse: not a storage training can follow
        main(args[:-1] + ["q4_1"])
    with pytest.raises(ValueError, match="trained with quant_aware='q4_0', not None: resume with --quant-aware q4_0"):
        main(args[:-2] + ["--resume", "--max-steps", "4"])
    main(args[:-2] + ["--quant-aware", "q4_0", "--resume", "--max-steps", "4"])  # the same storage goes on
    assert load_checkpoint(tmp_path / "run")["step"] == 4

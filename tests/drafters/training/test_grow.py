"""Growing a trained drafter (more draft layers, a wider MLP, more target layers): the grown drafter
computes exactly what the original does, every new weight is trained, and shrinking is refused."""

import json
from dataclasses import replace

import pytest
import torch

from drafters.dflash_model import load_dflash, save_dflash
from drafters.training.anchors import block_labels
from drafters.training.forward import block_loss
from drafters.training.grow import grow, shape_of
from tests.training_helpers import BLOCK, SHAPE, block_logits_of, toy_data_dir

BIGGER = replace(SHAPE, num_layers=3, intermediate_size=128, target_layer_ids=(0, 1, 2))


def test_grown_drafter_computes_the_same_and_trains_every_new_weight(setup):
    root, hf, drafter = setup
    target_config = hf.config
    grown = grow(drafter, target_config, BIGGER, seed=5)
    assert shape_of(grown) == BIGGER
    sequences = [list(range(10, 30)), list(range(40, 58)) + [3, 4]]
    anchors = [[4, 9, 13], [5, 6, 12]]
    with torch.no_grad():
        want, _ = block_logits_of(drafter, root, sequences, anchors)
        got, _ = block_logits_of(grown, root, sequences, anchors)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # the weights that make the growth invisible (zero) get a gradient from the first step
    _, (frozen, batch, anchor_set, hidden) = block_logits_of(grown, root, sequences, anchors)
    labels, weights = block_labels(batch.input_ids, batch.loss_mask, anchor_set, BLOCK, 4.0)
    block_loss(grown, hidden, frozen.lm_head, labels, weights).loss.backward()
    grads = {name: p.grad for name, p in grown.named_parameters()}
    hidden_size = target_config.hidden_size
    assert grads["fc.weight"][:, hidden_size:2 * hidden_size].abs().sum() > 0  # the new target layer's columns
    assert grads["layers.0.mlp.down_proj.weight"][:, SHAPE.intermediate_size:].abs().sum() > 0  # new MLP units
    assert grads["layers.2.self_attn.o_proj.weight"].abs().sum() > 0  # the new draft layer
    assert grads["layers.2.mlp.down_proj.weight"].abs().sum() > 0


def test_growing_through_the_train_script(setup, tmp_path):
    """--init-from with shape flags: the run starts from the grown weights, same outputs as the original."""
    root, hf, drafter = setup
    save_dflash(drafter, tmp_path / "small", dtype=torch.float32)
    data = toy_data_dir(tmp_path / "data")
    from drafters.training.checkpoint import drafter_from_checkpoint
    from scripts.train_drafter import main

    main(["--data", str(data), "--out", str(tmp_path / "run"), "--target", str(root / "target"),
          "--init-from", str(tmp_path / "small"), "--draft-layers", "3", "--intermediate-size", "128",
          "--target-layer-ids", "0,1,2", "--device", "cpu", "--max-steps", "5", "--eval-fraction", "0.2",
          "--time-budget-s", "0"])
    started = drafter_from_checkpoint(tmp_path / "run")
    assert shape_of(started) == BIGGER
    with torch.no_grad():
        want, _ = block_logits_of(load_dflash(tmp_path / "small", torch.device("cpu"), torch.float32), root,
                                  [list(range(10, 30))], [[4, 9]])
        got, _ = block_logits_of(started, root, [list(range(10, 30))], [[4, 9]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    # --eval-only: one held-out score of the starting weights in the log, no training
    main(["--data", str(data), "--out", str(tmp_path / "score"), "--target", str(root / "target"),
          "--init-from", str(tmp_path / "small"), "--device", "cpu", "--eval-fraction", "0.5", "--eval-only"])
    lines = (tmp_path / "score" / "log.jsonl").read_text().splitlines()
    with pytest.raises(SystemExit, match="no held-out sequences"):
        main(["--data", str(data), "--out", str(tmp_path / "none"), "--target", str(root / "target"),
              "--init-from", str(tmp_path / "small"), "--device", "cpu", "--eval-fraction", "0", "--eval-only"])
    assert len(lines) == 1 and json.loads(lines[0])["tau_estimate"] >= 1.0
    assert not (tmp_path / "score" / "checkpoint.pt").exists()


@pytest.mark.parametrize("change, message", [
    (dict(num_layers=1), "num_layers 1 < the drafter's 2"),
    (dict(intermediate_size=64), "intermediate_size 64 < the drafter's 96"),
    (dict(heads=2), "heads 2 != the drafter's 4"),
    (dict(target_layer_ids=(1, 2)), r"drop the drafter's \[0\]"),
])
def test_growing_refuses_what_would_change_or_shrink_the_drafter(setup, change, message):
    root, hf, drafter = setup
    with pytest.raises(ValueError, match=message):
        grow(drafter, hf.config, replace(SHAPE, **change))

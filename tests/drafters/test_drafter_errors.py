"""A drafter that does not fit its target is refused before generation, naming the values."""

import json

import pytest

from drafters import load_drafter
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter
from tests.engine_helpers import tiny_target


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("errors-target")
    build_tiny_model("qwen3", path)
    return tiny_target(path)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 32}, "hidden_size 32 != the target's 64"),
    ({"num_target_layers": 7}, "num_target_layers 7 != the target's 4 layers"),
    ({"dflash_config": {"target_layer_ids": [0, 9], "mask_token_id": 5}}, r"\[9\] outside 0..3"),
    ({"dflash_config": {"mask_token_id": 500}}, "mask_token_id 500 is outside the target's embedding"),
    ({"vocab_size": 1000}, "vocab_size 1000 != the target's 96"),
    ({"dflash_config": {"mask_token_id": 5, "draft_window": -3}}, "draft_window must be a non-negative integer"),
])
def test_incompatible_drafter_is_named(target, tmp_path, change, message):
    build_random_drafter(tmp_path / "d", target.model.config, target_layer_ids=[0, 2])
    config_file = tmp_path / "d" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(ValueError, match=message):
        load_drafter(tmp_path / "d", target.model)


def test_missing_drafter_is_named(target):
    with pytest.raises(FileNotFoundError, match="neither a directory, a shipped drafter"):
        load_drafter("/no/such/drafter", target.model)


def test_not_a_dflash_checkpoint(target, tmp_path):
    target.model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not describe a DFlashDraftModel"):
        load_drafter(tmp_path, target.model)

"""Shared by the drafter training tests: a drafter shape, toy data and a trainer over the tiny target."""

import torch
from transformers import AutoModelForCausalLM

from drafters.training.anchors import Anchors, block_input_ids
from drafters.training.data import TokenSamples, collate
from drafters.training.drafter_config import DrafterShape, drafter_config, new_drafter
from drafters.training.forward import block_hidden
from drafters.training.target import FrozenTarget
from drafters.training.trainer import TrainConfig, Trainer
from tests.conftest import VOCAB

BLOCK = 5
MASK = VOCAB - 1
SHAPE = DrafterShape(num_layers=2, heads=4, kv_heads=2, head_dim=16, intermediate_size=96, block_size=BLOCK,
                     target_layer_ids=(0, 2))


def frozen_target(root) -> FrozenTarget:
    return FrozenTarget(AutoModelForCausalLM.from_pretrained(root / "target"), SHAPE.target_layer_ids)


def toy_samples(n=4, length=40, prompt_len=8, seed=0) -> TokenSamples:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, MASK, (length - 2 * i,), generator=g).tolist()
        rows.append((ids[:prompt_len], ids[prompt_len:], i))
    return TokenSamples.from_lists(rows)


def toy_data_dir(path, n=6):
    """A training-data directory holding one shard of `toy_samples(n)`."""
    path.mkdir()
    toy_samples(n=n).save(path / "shard-00000.safetensors")
    return path


def batch_of(sequences, prompt_lens):
    samples = TokenSamples.from_lists([(s[:p], s[p:], i) for i, (s, p) in enumerate(zip(sequences, prompt_lens))])
    return collate(samples, range(len(sequences)), max_length=4096)


# ---- (a) anchors, mask, labels -----------------------------------------------------------------


def make_trainer(root, out_dir, drafter_state, **overrides):
    config = dict(out_dir=str(out_dir), max_steps=20, batch_size=4, anchors_per_seq=8, gamma=4.0, lr=1e-2,
                  warmup_frac=0.1, loss_chunk=64, eval_every=10, save_every=1000, eval_sequences=2,
                  eval_anchors_per_seq=8)
    config.update(overrides)
    drafter = new_drafter(drafter_config(frozen_target(root).config, SHAPE, MASK), seed=3)
    drafter.load_state_dict(drafter_state)
    return Trainer(TrainConfig(**config), drafter, frozen_target(root), toy_samples(), toy_samples(n=2, seed=1))


def block_logits_of(drafter, root, sequences, anchors):
    """The drafter's block logits at `anchors` of `sequences`, with the target features its config names."""
    frozen = FrozenTarget(AutoModelForCausalLM.from_pretrained(root / "target"), drafter.spec.target_layer_ids)
    batch = batch_of(sequences, [4] * len(sequences))
    anchor_set = Anchors(torch.tensor(anchors), torch.ones(len(anchors), len(anchors[0]), dtype=torch.bool))
    embeds = frozen.embed(block_input_ids(batch.input_ids, anchor_set, BLOCK, MASK))
    hidden = block_hidden(drafter, frozen.features(batch.input_ids), embeds, anchor_set.positions)
    return drafter.block_logits(hidden, frozen.lm_head), (frozen, batch, anchor_set, hidden)

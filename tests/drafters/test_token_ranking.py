"""A drafter's token ranking and the draft vocabulary it gives: draft steps score only the most frequent tokens,
with the target's output rows of those tokens, and what is committed stays the target's own choice."""

import numpy as np
import pytest
import torch

from drafters import load_drafter
from drafters.token_ranking import (PLAIN_RANKING_FILE, RANKING_FILE, draft_vocabulary, rank_tokens, read_token_ranking,
                                    write_token_ranking)
from specdec.engine.config import EngineConfig
from specdec.engine.sampling_params import SamplingParams
from tests.conftest import VOCAB
from tests.drafter_helpers import build_random_drafter
from tests.engine_helpers import MANY_PROMPTS, assert_no_leak, module_target, spec_engine, tiny_engine, tiny_target

target_dir = module_target("ranked-drafts", seed=11)
# a ranking of 40 of the tiny vocabulary's 96 tokens, in a seeded order
RANKING = np.random.default_rng(3).permutation(VOCAB)[:40].astype(np.int32)


def test_tokens_are_ranked_by_count_then_id_with_the_given_ones_first():
    ranking = rank_tokens([[5, 3, 3, 9], [9, 3, 7]], 12, first=[7, 11])
    assert ranking.tolist() == [7, 11, 3, 9, 5]  # 3 thrice, 9 twice, 5 once; 7 and 11 lead (7 not repeated)
    assert ranking.dtype == np.int32
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 12\)"):
        rank_tokens([[1, 12]], 12)


def test_a_ranking_is_read_back_as_written_and_a_bad_one_is_refused(tmp_path):
    assert read_token_ranking(tmp_path) is None  # none: the whole vocabulary
    write_token_ranking(tmp_path, np.array([4, 1, 9]))
    assert read_token_ranking(tmp_path).tolist() == [4, 1, 9]
    write_token_ranking(tmp_path, np.array([4, 4, 1]))
    with pytest.raises(ValueError, match="distinct token ids"):
        read_token_ranking(tmp_path)
    for content in (b"not an array", b"PK\x03\x04 a broken zip"):
        (tmp_path / RANKING_FILE).write_bytes(content)
        with pytest.raises(ValueError, match="cannot read the token ranking"):
            read_token_ranking(tmp_path)
    np.savez_compressed(tmp_path / RANKING_FILE, other=np.array([4, 1, 9]))
    with pytest.raises(ValueError, match="cannot read the token ranking"):
        read_token_ranking(tmp_path)


def test_a_ranking_written_as_a_plain_array_is_read_and_a_new_ranking_replaces_it(tmp_path):
    np.save(tmp_path / PLAIN_RANKING_FILE, np.array([7, 2, 5], dtype=np.int32))
    assert read_token_ranking(tmp_path).tolist() == [7, 2, 5]
    write_token_ranking(tmp_path, np.array([3, 8]))
    assert not (tmp_path / PLAIN_RANKING_FILE).exists()
    assert read_token_ranking(tmp_path).tolist() == [3, 8]


def test_the_draft_vocabulary_is_the_most_frequent_ids_ascending():
    ranking = np.array([8, 2, 5, 0, 7])
    assert draft_vocabulary(ranking, 3, 10).tolist() == [2, 5, 8]
    assert draft_vocabulary(ranking, 9, 10).tolist() == [0, 2, 5, 7, 8]  # all it ranks
    assert draft_vocabulary(ranking, 0, 10) is None
    assert draft_vocabulary(ranking, 10, 10) is None  # the whole vocabulary anyway
    assert draft_vocabulary(None, 3, 10) is None
    with pytest.raises(ValueError, match="outside the target's vocabulary of 6"):
        draft_vocabulary(ranking, 3, 6)
    with pytest.raises(ValueError, match="draft_vocab must be 0"):
        EngineConfig(draft_vocab=-1)


def ranked_drafter(target_dir, tmp_path, ranked: bool):
    """A random block-4 drafter, with RANKING beside its weights or without a ranking."""
    target = tiny_target(target_dir)
    folder = tmp_path / ("ranked" if ranked else "plain")
    build_random_drafter(folder, target.model.config, seed=4, block_size=4)
    if ranked:
        write_token_ranking(folder, RANKING)
    return load_drafter(folder, target.model)


def first_draft(engine, prompt):
    """The first draft step's logits and drafts of `prompt` (its prefill run first)."""
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=8))
    engine.step()
    logits = engine.drafter.draft_logits([request]).clone()
    drafts = engine.drafter.propose([request])[0].clone()
    engine.abort(request.request_id)
    return logits, drafts


@pytest.mark.parametrize("size", [24, 40])
def test_drafts_come_from_the_target_rows_of_the_most_frequent_tokens(target_dir, tmp_path, size):
    """The draft head scores the top `size` ranked tokens with the target's own output rows: its logits are the
    whole-vocabulary logits at those columns, and each draft is the best of them."""
    ids = np.sort(RANKING[:size])
    whole = spec_engine(target_dir, ranked_drafter(target_dir, tmp_path, ranked=False), overlap_steps=False)
    ranked = spec_engine(target_dir, ranked_drafter(target_dir, tmp_path, ranked=True), overlap_steps=False,
                         draft_vocab=size)
    assert ranked.drafter.draft_ids.tolist() == ids.tolist()
    for prompt in MANY_PROMPTS[:3]:
        full_logits, _ = first_draft(whole, prompt)
        logits, drafts = first_draft(ranked, prompt)
        torch.testing.assert_close(logits, full_logits[..., torch.from_numpy(ids).long()])
        assert drafts.tolist() == ids[logits.argmax(dim=-1)[0].numpy()].tolist()
        assert set(drafts.tolist()) <= set(ids.tolist())


def test_the_draft_vocabulary_by_size(target_dir, tmp_path):
    """A size past the ranking but short of the vocabulary drafts over the whole ranking; the default (0), sizes of the
    vocabulary or more, and a drafter without a ranking draft over the whole vocabulary."""
    def draft_ids(ranked=True, **config):
        ids = spec_engine(target_dir, ranked_drafter(target_dir, tmp_path, ranked), **config).drafter.draft_ids
        return None if ids is None else ids.tolist()

    assert draft_ids(draft_vocab=60) == np.sort(RANKING).tolist()
    assert draft_ids() is None and draft_ids(draft_vocab=VOCAB) is None and draft_ids(draft_vocab=0) is None
    assert draft_ids(ranked=False, draft_vocab=8) is None
    with pytest.raises(ValueError, match="draft_vocab 2 leaves 2 tokens to draft from, fewer than the 4 candidates"):
        draft_ids(verify="tree", draft_vocab=2)  # trees take each position's top 4


@pytest.mark.parametrize("verify", ["chain", "auto", "tree"])
def test_greedy_output_with_a_draft_vocabulary_equals_autoregressive(target_dir, tmp_path, verify):
    prompts = MANY_PROMPTS[:5]
    expected = [r.output_ids for r in tiny_engine(target_dir, eos=()).generate_ids(
        prompts, SamplingParams(max_new_tokens=21))]
    engine = spec_engine(target_dir, ranked_drafter(target_dir, tmp_path, ranked=True), verify=verify, draft_vocab=16)
    got = engine.generate_ids(prompts, SamplingParams(max_new_tokens=21))
    assert [r.output_ids for r in got] == expected
    assert all(r.stats.verify_steps > 0 for r in got)
    assert_no_leak(engine)

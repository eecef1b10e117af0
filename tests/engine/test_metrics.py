"""The acceptance statistics of a run: per-position acceptance counts a position only where it was verified."""

import pytest

from specdec.engine.metrics import RequestStats, summarize


def test_per_position_acceptance_and_verified_tokens_with_steps_of_several_lengths():
    # block 4: one step verified the whole block and accepted 2 drafts (n = 3); two steps verified 2 tokens
    # (one draft): one accepted it (n = 2), one did not (n = 1)
    stats = RequestStats(generated_tokens=6, block_size=4, acceptance_lengths=[3, 2, 1], verify_lengths=[4, 2, 2])
    summary = summarize([stats], wall_time=1.0)
    # position 1: verified 3 times, accepted twice; positions 2 and 3: verified once (accepted, rejected)
    assert summary.per_position_acceptance == pytest.approx([2 / 3, 1.0, 0.0])
    assert summary.verified_per_step == pytest.approx(8 / 3) and summary.tau_overall == pytest.approx(2.0)


def test_steps_without_recorded_lengths_count_as_whole_blocks():
    stats = RequestStats(generated_tokens=4, block_size=4, acceptance_lengths=[4, 1])
    summary = summarize([stats], wall_time=1.0)
    assert summary.per_position_acceptance == pytest.approx([0.5, 0.5, 0.5])
    assert summary.verified_per_step == 4.0
    assert summarize([RequestStats(generated_tokens=3)], 1.0).verified_per_step is None

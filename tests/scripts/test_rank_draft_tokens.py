"""scripts/rank_draft_tokens.py: a drafter's token ranking from its training answers or from texts."""

import json

import numpy as np

from drafters.token_ranking import rank_tokens, read_token_ranking
from scripts.rank_draft_tokens import main
from tests.conftest import build_tiny_model_with_tokenizer
from tests.training_helpers import toy_samples


def test_training_answers_are_ranked_with_the_end_of_turn_token_first(tmp_path):
    target = build_tiny_model_with_tokenizer(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    samples = toy_samples(n=6)
    samples.save(data / "shard-00000.safetensors")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    assert main([str(drafter), "--target", str(target), "--data", str(data)]) == 0
    answers = [samples[i][0][samples[i][1]:].tolist() for i in range(len(samples))]  # prompts are not counted
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    assert read_token_ranking(drafter).tolist() == rank_tokens(answers, vocab, first=[eos]).tolist()


def test_texts_are_ranked_by_their_tokens(tmp_path):
    target = build_tiny_model_with_tokenizer(tmp_path / "target")
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"problem": "p", "solution": s}) + "\n" for s in ("aab", "ab a", "b")))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    assert main([str(drafter), "--target", str(target), "--texts", "math", "code", "--problems", str(problems),
                 "--code-chars", "3000"]) == 0
    ranking = read_token_ranking(drafter)
    assert len(ranking) == len(np.unique(ranking)) > 3  # the solutions' tokens and some Python source's

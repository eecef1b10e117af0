"""Rank a drafter's tokens by frequency and write the ranking beside its weights (drafters/token_ranking.py), so that
its draft steps may score only the most frequent ones (`--draft-vocab N`).

    python scripts/rank_draft_tokens.py DRAFTER_DIR --data data/mix-qc15 [data/more ...]    # its training answers
    python scripts/rank_draft_tokens.py DRAFTER_DIR --texts math code                      # texts like the target's

`--data` counts the answer tokens of training data (`scripts/generate_training_data.py`'s shards): exactly what the
drafter learned to predict. `--texts` counts texts of the kinds the target answers, tokenized with the target's
tokenizer: `math`, the MATH training solutions; `code`, Python source of the standard library and of the libraries
the training's coding requests come from (a seeded sample of `--code-chars` characters). Either way the target's end
of turn tokens lead the ranking (every answer ends with one).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import AutoConfig, AutoTokenizer  # noqa: E402

from drafters import resolve_drafter_path  # noqa: E402
from drafters.token_ranking import rank_tokens, write_token_ranking  # noqa: E402
from specdec.models.loader import eos_token_ids  # noqa: E402
from specdec.weights.demo_models import DEFAULT_TARGET, resolve_model  # noqa: E402

DEFAULT_PROBLEMS = ROOT.parent / "shared" / "data" / "math_train.jsonl"
KEEP = 65536  # ids written: more than any draft vocabulary worth its cost


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drafter", help="drafter directory or shipped name")
    p.add_argument("--target", default=DEFAULT_TARGET, help="demo name or HF dir (its tokenizer)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", help="training data directories (their answers' tokens)")
    source.add_argument("--texts", nargs="+", choices=("math", "code"), help="texts of these kinds")
    p.add_argument("--problems", default=str(DEFAULT_PROBLEMS), help="MATH training problems (jsonl, 'solution')")
    p.add_argument("--code-chars", type=int, default=8_000_000, help="characters of Python source counted")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def answer_tokens(directories: list[str]):
    from drafters.training.data import load_samples

    samples = load_samples(*directories)
    for i in range(len(samples)):
        ids, prompt_len = samples[i]
        yield ids[prompt_len:].numpy()


def math_texts(problems: str):
    with open(problems) as f:
        for line in f:
            yield json.loads(line)["solution"]


def code_texts(chars: int, seed: int):
    from drafters.training.stdlib_tasks import LIBRARY_PACKAGES, package_files, stdlib_files

    files = [path for path, _ in stdlib_files() + package_files(LIBRARY_PACKAGES)]
    random.Random(seed).shuffle(files)
    for path in files:
        if chars <= 0:
            return
        text = path.read_text(errors="replace")
        chars -= len(text)
        yield text


def main(argv=None) -> int:
    args = parse_args(argv)
    drafter = resolve_drafter_path(args.drafter)
    model_dir = Path(resolve_model(args.target))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    if args.data:
        sequences = answer_tokens(args.data)
    else:
        texts = {"math": lambda: math_texts(args.problems), "code": lambda: code_texts(args.code_chars, args.seed)}
        sequences = (tokenizer(text, add_special_tokens=False)["input_ids"]
                     for kind in args.texts for text in texts[kind]())
    ranking = rank_tokens(sequences, vocab_size, first=sorted(eos_token_ids(model_dir, tokenizer)))[:KEEP]
    path = write_token_ranking(drafter, ranking)
    print(f"{len(ranking)} token ids ranked -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

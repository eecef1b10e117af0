"""Training data from the target itself: its answers to MATH training problems, in resumable shards.

Shard i holds the answers to problems [i * shard_size, (i + 1) * shard_size) (indices into the
problem file): per problem one greedy answer (unless turned off) and `samples_per_problem`
sampled ones, each with its own seed so that a shard's content does not depend on the batch it
ran in. A shard is written once, atomically, when every request in it has finished; a finished
shard is skipped by a later run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from drafters.training.data import TokenSamples, shard_metadata, shard_path
from specdec.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# the math500 user turn (z-lab's benchmark prompt), applied to the training problems
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def read_problems(path: str | os.PathLike) -> list[str]:
    """The `problem` field of every line of a JSONL file."""
    with open(path) as f:
        return [json.loads(line)["problem"] for line in f if line.strip()]


def math_prompt_ids(tokenizer, problem: str) -> list[int]:
    """Chat-formatted prompt ids: one user turn, generation prompt added (as `LLM.encode(chat=True)`)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": problem + MATH_INSTRUCTION}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 1024
    greedy: bool = True  # one temperature-0 answer per problem
    samples_per_problem: int = 0  # extra sampled answers per problem
    temperature: float = 0.8
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 256  # problems per shard

    def __post_init__(self):
        if not self.greedy and self.samples_per_problem < 1:
            raise ValueError("nothing to generate: greedy is off and samples_per_problem is 0")
        if self.samples_per_problem and self.temperature <= 0:
            raise ValueError("sampled answers need temperature > 0")
        if self.shard_size < 1:
            raise ValueError("shard_size must be positive")
        if not 0 <= self.samples_per_problem < 1000:
            raise ValueError("samples_per_problem must be in 0..999")

    def params(self, problem_id: int) -> list[SamplingParams]:
        """The requests for one problem: greedy first, then samples with per-(problem, sample) seeds."""
        out = [SamplingParams(max_new_tokens=self.max_new_tokens)] if self.greedy else []
        for k in range(self.samples_per_problem):
            out.append(SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                      top_p=self.top_p, seed=(self.seed * 1_000_003 + problem_id) * 1000 + k))
        return out


def shard_is_complete(path: Path, num_problems: int) -> bool:
    return path.is_file() and shard_metadata(path).get("num_problems") == num_problems


def generate_shards(engine, prompts: list[list[int]], out_dir: str | os.PathLike, settings: GenerationSettings,
                    start: int = 0, limit: int | None = None, metadata: dict | None = None,
                    deadline: float | None = None, progress: bool = True) -> list[Path]:
    """Answer prompts[start : start + limit] (prompt i is problem i) shard by shard with `engine`
    (a `specdec.engine.Engine`); returns the finished shard files of that range, old and new.

    deadline: a `time.monotonic()` value; no shard is started that would likely end after it
    (judged by the longest shard so far)."""
    n = settings.shard_size
    if start % n:
        raise ValueError(f"start {start} must be a multiple of the shard size {n} (shards cover fixed problem ranges)")
    end = len(prompts) if limit is None else min(len(prompts), start + limit)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    shards = range(start // n, -(-end // n))
    longest = 0.0
    bar = tqdm(shards, desc="shards", disable=not progress, dynamic_ncols=True)
    for index in bar:
        first, last = index * n, min(end, (index + 1) * n)
        path = shard_path(out_dir, index)
        if shard_is_complete(path, last - first):
            files.append(path)
            continue
        if deadline is not None and time.monotonic() + 1.2 * longest > deadline:
            log.warning("time budget: stopping before shard %d (problems %d..); run again to continue", index, first)
            break
        started = time.monotonic()
        samples, tokens = _answer(engine, prompts, range(first, last), settings, bar)
        longest = max(longest, time.monotonic() - started)
        meta = {**(metadata or {}), "first_problem": first, "num_problems": last - first,
                "num_samples": len(samples), **vars(settings)}
        samples.save(path, meta)
        files.append(path)
        bar.set_postfix(shard=index, samples=len(samples), tokens=tokens)
    return files


def _answer(engine, prompts, problem_ids, settings: GenerationSettings, bar) -> tuple[TokenSamples, int]:
    requests, owners = [], []
    for pid in problem_ids:
        for params in settings.params(pid):
            requests.append(engine.make_request(prompts[pid], params))
            owners.append(pid)
    generated = 0

    def on_commit(request, tokens):
        nonlocal generated
        generated += len(tokens)
        if generated % 4096 < len(tokens):
            bar.set_postfix(generated=generated, refresh=True)

    engine.run(requests, on_commit)
    rows = []
    for request, pid in zip(requests, owners):
        if request.finish_reason == "error":
            log.warning("problem %d: request failed (%s); left out", pid, request.error)
            continue
        rows.append((list(request.prompt_ids), list(request.output_ids), pid))
    return TokenSamples.from_lists(rows), generated

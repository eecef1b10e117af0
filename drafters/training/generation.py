"""Training data from the target itself: its answers to a list of prompts, in resumable shards.

Shard i holds the answers to prompts [i * shard_size, (i + 1) * shard_size) (indices into the
prompt list, called problem ids): per prompt one greedy answer (unless turned off) and
`samples_per_problem` sampled ones, each with its own seed so that a shard's content does not
depend on the batch it ran in, and the domain of each. A shard is written once, atomically, when
every request in it has finished; a later run skips a finished shard whose prompts are still the
same (a digest of the range's token ids and domains is stored with it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from drafters.training.data import DEFAULT_DOMAIN, TokenSamples, shard_metadata, shard_path
from specdec.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 1024
    greedy: bool = True  # one temperature-0 answer per problem
    samples_per_problem: int = 0  # extra sampled answers per problem
    temperatures: tuple[float, ...] = (0.8,)  # sampled answer k uses temperatures[k % len]
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 256  # problems per shard

    def __post_init__(self):
        object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
        if not self.greedy and self.samples_per_problem < 1:
            raise ValueError("nothing to generate: greedy is off and samples_per_problem is 0")
        if self.samples_per_problem and (not self.temperatures or min(self.temperatures) <= 0):
            raise ValueError("sampled answers need temperatures > 0")
        if self.shard_size < 1:
            raise ValueError("shard_size must be positive")
        if not 0 <= self.samples_per_problem < 1000:
            raise ValueError("samples_per_problem must be in 0..999")

    def params(self, problem_id: int) -> list[SamplingParams]:
        """The requests for one problem: greedy first, then samples with per-(problem, sample) seeds."""
        out = [SamplingParams(max_new_tokens=self.max_new_tokens)] if self.greedy else []
        for k in range(self.samples_per_problem):
            out.append(SamplingParams(max_new_tokens=self.max_new_tokens,
                                      temperature=self.temperatures[k % len(self.temperatures)],
                                      top_p=self.top_p, seed=(self.seed * 1_000_003 + problem_id) * 1000 + k))
        return out


def prompt_digest(prompts: list[list[int]], domains: list[str]) -> str:
    """What a shard answered: its prompts' token ids and domains."""
    return hashlib.sha256(json.dumps([prompts, domains]).encode()).hexdigest()


def shard_is_complete(path: Path, num_problems: int, digest: str) -> bool:
    if not path.is_file():
        return False
    metadata = shard_metadata(path)
    if metadata.get("num_problems") != num_problems:
        return False
    if metadata.get("prompt_digest") != digest:
        log.warning("%s answers other prompts than the current list; generating it again", path)
        return False
    return True


def generate_shards(engine, prompts: list[list[int]], out_dir: str | os.PathLike, settings: GenerationSettings,
                    start: int = 0, limit: int | None = None, metadata: dict | None = None,
                    deadline: float | None = None, progress: bool = True,
                    domains: list[str] | None = None) -> list[Path]:
    """Answer prompts[start : start + limit] (prompt i is problem i, of domain domains[i]) shard by
    shard with `engine` (a `specdec.engine.engine.Engine`); returns the finished shard files of that range,
    old and new.

    Shards are pipelined: the next shard's requests join the engine while the current one's are still
    decoding (whenever fewer than a batch of requests wait), so the batch stays full to the last shard
    instead of draining at the end of each. A shard is written as soon as its last request finishes.

    deadline: a `time.monotonic()` value; no shard is started that would likely end after it (see
    `next_shard_fits`)."""
    domains = [DEFAULT_DOMAIN] * len(prompts) if domains is None else domains
    if len(domains) != len(prompts):
        raise ValueError(f"{len(domains)} domains for {len(prompts)} prompts")
    n = settings.shard_size
    if start % n:
        raise ValueError(f"start {start} must be a multiple of the shard size {n} (shards cover fixed problem ranges)")
    end = len(prompts) if limit is None else min(len(prompts), start + limit)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files, todo = [], deque()
    for index in range(start // n, -(-end // n)):
        first, last = index * n, min(end, (index + 1) * n)
        job = ShardJob(index, range(first, last), shard_path(out_dir, index),
                       prompt_digest(prompts[first:last], domains[first:last]))
        if shard_is_complete(job.path, len(job.problem_ids), job.digest):
            files.append(job.path)
        else:
            todo.append(job)
    bar = tqdm(total=len(files) + len(todo), initial=len(files), desc="shards", disable=not progress,
               dynamic_ncols=True)
    files += _answer_shards(engine, prompts, domains, todo, settings, metadata or {}, deadline, bar)
    bar.close()
    return files


@dataclass
class ShardJob:
    """One shard's problems and, once submitted, its requests."""
    index: int
    problem_ids: range
    path: Path
    digest: str
    requests: list = field(default_factory=list)
    owners: list[int] = field(default_factory=list)  # the problem of each request
    started: float = 0.0

    def submit(self, engine, prompts, settings: GenerationSettings) -> None:
        self.started = time.monotonic()
        for pid in self.problem_ids:
            for params in settings.params(pid):
                self.requests.append(engine.add_request(prompts[pid], params))
                self.owners.append(pid)

    @property
    def done(self) -> bool:
        return all(r.finished for r in self.requests)

    @property
    def fraction_done(self) -> float:
        return sum(r.finished for r in self.requests) / max(len(self.requests), 1)

    def samples(self, domains) -> TokenSamples:
        rows, row_domains = [], []
        for request, pid in zip(self.requests, self.owners):
            if request.finish_reason == "error":
                log.warning("problem %d: request failed (%s); left out", pid, request.error)
                continue
            rows.append((list(request.prompt_ids), list(request.output_ids), pid))
            row_domains.append(domains[pid])
        return TokenSamples.from_lists(rows, row_domains)


def next_shard_fits(elapsed_s: float, finished_shards: int, in_flight: list[float], remaining_s: float,
                    margin: float = 1.2) -> bool:
    """Would one more shard, after the ones in flight (each given by the fraction of its requests
    finished), end within remaining_s? Judged by throughput so far, in shards per second with the
    finished part of in-flight shards counted: shards overlap, so the first shard's latency alone
    overstates the time each further one adds (it stopped a 270 s budget after 158 s). Always yes
    before the first shard has finished (nothing to judge by)."""
    if not finished_shards:
        return True
    per_shard = elapsed_s / (finished_shards + sum(in_flight))
    outstanding = sum(1 - f for f in in_flight) + 1
    return margin * per_shard * outstanding <= remaining_s


def _answer_shards(engine, prompts, domains, todo: deque, settings: GenerationSettings, metadata: dict,
                   deadline: float | None, bar) -> list[Path]:
    files: list[Path] = []
    active: list[ShardJob] = []
    began, finished_shards = time.monotonic(), 0
    generated = 0

    def on_commit(request, tokens):
        nonlocal generated
        generated += len(tokens)
        if generated % 4096 < len(tokens):
            bar.set_postfix(generated=generated, tok_s=round(generated / max(time.monotonic() - began, 1e-9)),
                            refresh=True)

    def fits_before_deadline() -> bool:
        if deadline is None:
            return True
        now = time.monotonic()
        return next_shard_fits(now - began, finished_shards, [job.fraction_done for job in active], deadline - now)

    try:
        while todo or active:
            while todo and engine.num_waiting < engine.config.max_num_seqs:
                if not fits_before_deadline():
                    log.warning("time budget: stopping before shard %d (problems %d..); run again to continue",
                                todo[0].index, todo[0].problem_ids.start)
                    todo.clear()
                    break
                job = todo.popleft()
                job.submit(engine, prompts, settings)
                active.append(job)
            if engine.has_unfinished_requests:
                engine.step(on_commit)
            for job in [j for j in active if j.done]:
                active.remove(job)
                files.append(_save_shard(job, domains, settings, metadata))
                finished_shards += 1
                bar.update(1)
    except BaseException:
        engine.abort_all([r for job in active for r in job.requests])
        raise
    return files


def _save_shard(job: ShardJob, domains, settings: GenerationSettings, metadata: dict) -> Path:
    seconds = time.monotonic() - job.started
    samples = job.samples(domains)
    meta = {**metadata, "first_problem": job.problem_ids.start, "num_problems": len(job.problem_ids),
            "num_samples": len(samples), "prompt_digest": job.digest,
            "generated_tokens": sum(len(r.output_ids) for r in job.requests),
            "seconds": round(seconds, 2), **vars(settings)}
    samples.save(job.path, meta)
    return job.path

"""One pass of the problems through an `LLM`: generation in chunks, grading, the metrics summary."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from eval.problem_set import Graded, Grader
from specdec import SamplingParams
from specdec.engine.metrics import Summary, summarize

FAILED_REQUEST = Graded(None, False)  # a request that failed has nothing to grade and counts as wrong


@dataclass
class Run:
    label: str  # "speculative", "autoregressive" or "baseline"
    metric: str  # the grader's name for the fraction correct: "accuracy", "pass@1"
    results: list  # specdec GenerationResult per problem, in problem order
    graded: list[Graded]  # per problem, in problem order
    summary: Summary  # over the requests that did not fail
    wall_time: float  # seconds inside llm.generate (grading after generation is not timed)

    @property
    def extracted(self) -> list[str | None]:
        return [g.extracted for g in self.graded]

    @property
    def correct(self) -> list[bool]:
        return [g.correct for g in self.graded]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    @property
    def errors(self) -> int:
        return sum(r.finish_reason == "error" for r in self.results)

    @property
    def cut_off(self) -> int:
        """Answers that max_new_tokens ended before the model did (graded as they stand)."""
        return sum(r.finish_reason == "length" for r in self.results)

    def as_dict(self) -> dict:
        return {"mode": self.label, "metric": self.metric, "accuracy": self.accuracy, "correct": sum(self.correct),
                "problems": len(self.correct), "errors": self.errors, "cut_off": self.cut_off,
                "summary": self.summary.as_dict()}


def grade_result(grader: Grader, problem, result) -> Graded:
    return FAILED_REQUEST if result.finish_reason == "error" else grader.grade(problem, result.text)


def grade_all(grader: Grader, problems: list, results: list, progress_bar) -> list[Graded]:
    """Grade every result: on `grader.grading_threads` threads (each grading may wait on a subprocess), or on the
    calling thread where the grader asks for none."""
    pairs = list(zip(problems, results))
    if grader.grading_threads is None:
        graded = [grade_result(grader, *pair) for pair in pairs]
    else:
        with ThreadPoolExecutor(max_workers=grader.grading_threads, thread_name_prefix="grading") as pool:
            graded = list(pool.map(lambda pair: grade_result(grader, *pair), pairs))
    progress_bar.set_postfix({grader.metric: f"{sum(g.correct for g in graded) / max(len(graded), 1):.3f}"})
    return graded


def run_problems(llm, problems: list, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                 grader: Grader, label: str, progress: bool = True, title: str = "") -> Run:
    """Generate for every prompt with at most `concurrency` requests in flight (the engine's
    max_num_seqs; a finished request's slot is refilled at once), then grade every response: grading a request as
    it finished would run on the engine's thread, pausing every request in flight inside the timed generation. With
    concurrency 1 this is exactly the batch-1 protocol. `title` (the problem set's name) prefixes the progress bar."""
    from tqdm import tqdm

    with tqdm(total=len(prompts), desc=f"{title} {label}".strip(), unit="problem", disable=not progress) as bar:
        began = time.perf_counter()
        results = llm.generate(prompts, params, on_finish=lambda i, result: bar.update(1))
        wall = time.perf_counter() - began
        graded = grade_all(grader, problems, results, bar)
    summary = summarize([r.stats for r in results if r.finish_reason != "error"], wall)
    return Run(label, grader.metric, results, graded, summary, wall)

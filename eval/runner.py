"""One pass of the problems through an `LLM`: generation in chunks, grading, the metrics summary."""

from __future__ import annotations

import time
from dataclasses import dataclass

from eval.grading import Grader, last_boxed
from eval.problems import Problem
from specdec import SamplingParams
from specdec.metrics import Summary, summarize


@dataclass
class Run:
    label: str  # "speculative" or "autoregressive"
    results: list  # specdec GenerationResult per problem, in problem order
    extracted: list[str | None]  # last \boxed{} content per problem
    correct: list[bool]
    summary: Summary  # over the requests that did not fail
    wall_time: float  # seconds inside llm.generate

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    @property
    def errors(self) -> int:
        return sum(r.finish_reason == "error" for r in self.results)

    def as_dict(self) -> dict:
        return {"mode": self.label, "accuracy": self.accuracy, "correct": sum(self.correct),
                "problems": len(self.correct), "errors": self.errors, "summary": self.summary.as_dict()}


def run_problems(llm, problems: list[Problem], prompts: list[list[int]], params: SamplingParams,
                 concurrency: int, grader: Grader, label: str, progress: bool = True) -> Run:
    """Generate for every prompt with at most `concurrency` requests in flight (the engine's
    max_num_seqs; a finished request's slot is refilled at once) and grade each response.
    With concurrency 1 this is exactly the batch-1 protocol."""
    from tqdm import tqdm

    extracted: list[str | None] = [None] * len(prompts)
    correct = [False] * len(prompts)
    done = 0
    with tqdm(total=len(prompts), desc=f"math500 {label}", unit="problem", disable=not progress) as bar:

        def on_finish(i, result):
            nonlocal done
            done += 1
            if result.finish_reason != "error":
                extracted[i] = last_boxed(result.text)
            correct[i] = grader.is_correct(extracted[i], problems[i].answer)
            bar.update(1)
            bar.set_postfix(acc=f"{sum(correct) / done:.3f}")

        began = time.perf_counter()
        results = llm.generate(prompts, params, on_finish=on_finish)
        wall = time.perf_counter() - began
    summary = summarize([r.stats for r in results if r.finish_reason != "error"], wall)
    return Run(label, results, extracted, correct, summary, wall)

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
    wall_time: float  # seconds inside llm.generate, summed over chunks

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
    """Generate for every prompt, `concurrency` requests at a time, and grade each response.

    Chunks of `concurrency` requests keep at most that many in flight and give the progress bar a
    point to advance; with concurrency 1 this is exactly the batch-1 protocol. With more, a chunk
    waits for its longest request before the next one starts (no refill mid-chunk)."""
    from tqdm import tqdm

    results, extracted, correct, wall = [], [], [], 0.0
    with tqdm(total=len(prompts), desc=f"math500 {label}", unit="problem", disable=not progress) as bar:
        for start in range(0, len(prompts), concurrency):
            began = time.perf_counter()
            chunk = llm.generate(prompts[start:start + concurrency], params)
            wall += time.perf_counter() - began
            for problem, result in zip(problems[start:start + concurrency], chunk):
                boxed = last_boxed(result.text) if result.finish_reason != "error" else None
                extracted.append(boxed)
                correct.append(grader.is_correct(boxed, problem.answer))
            results += chunk
            bar.update(len(chunk))
            bar.set_postfix(acc=f"{sum(correct) / len(correct):.3f}")
    summary = summarize([r.stats for r in results if r.finish_reason != "error"], wall)
    return Run(label, results, extracted, correct, summary, wall)

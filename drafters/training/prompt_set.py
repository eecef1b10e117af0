"""The prompt list of one training-data directory: user turns, each with its domain, built from a mix
of sources and stored beside the shards, so that a resumed run answers exactly the same list.

Sources, given as NAME:COUNT (COUNT `all`, or no COUNT, takes everything the source has):

    math          the MATH training problems (a JSONL with `problem`), in file order, each followed by
                  the math500 instruction
    code          coding requests from the standard library's code and docs (`stdlib_tasks`)
    libcode       the same requests about installed libraries' code (`stdlib_tasks.LIBRARY_PACKAGES`: numpy,
                  torch, sympy, ...; the recipe records their versions)
    general       general instructions over the topics of topics.json (`general_tasks`)
    selfinstruct  requests the target writes itself from seed topics (`self_instruct`; needs the target)

or a JSONL file of ready prompts (`prompt` and `domain` fields). Texts of earlier lists can be left out
(their recipes rebuilt offline), so that new data asks new questions: each source then takes its first
COUNT candidates that are not among them. A text given by two sources is kept once (the first); then the whole list is shuffled with the seed, so that every range of shards holds
the mix (a run cut short by its time budget still covers every domain). Benchmark files (HumanEval,
MBPP, math500) are refused.

Files in the data directory: `prompts.jsonl` (one {"domain", "prompt"} per line, prompt i is
problem i of the shards) and `prompts.recipe.json` (the sources and seed it was built from, the
count per domain, the Python version; a later run with another recipe is refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafters.training.general_tasks import general_prompts
from drafters.training.near_duplicates import unique_texts
from drafters.training.prompt_pool import seeded_order
from drafters.training.self_instruct import Completions, self_instruct_prompts
from drafters.training.stdlib_tasks import LIBRARY_PACKAGES, coding_prompts, installed_packages

log = logging.getLogger(__name__)

# the math500 user turn (z-lab's benchmark prompt), applied to the training problems
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
SOURCES = ("math", "code", "libcode", "general", "selfinstruct")
DEFAULT_SOURCES = ("math:7500", "code:6000", "general:2000")
PROMPTS_FILE = "prompts.jsonl"
RECIPE_FILE = "prompts.recipe.json"
BENCHMARK_FILE_NAME = re.compile(r"human[-_ ]?eval|mbpp|math[-_ ]?500", re.IGNORECASE)


@dataclass(frozen=True)
class Prompt:
    domain: str
    text: str  # the user turn


@dataclass(frozen=True)
class SourceSpec:
    name: str
    count: int | None  # None: all

    @classmethod
    def parse(cls, text: str) -> "SourceSpec":
        name, _, count = text.partition(":")
        if name not in SOURCES:
            raise ValueError(f"unknown prompt source {name!r} in {text!r}; sources: {', '.join(SOURCES)}")
        if count in ("", "all"):
            return cls(name, None)
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"the count in {text!r} must be a positive integer or 'all'")
        return cls(name, int(count))

    def __str__(self) -> str:
        return f"{self.name}:{'all' if self.count is None else self.count}"


@dataclass
class SourceInputs:
    """What the sources need besides their count and the seed."""
    problems: str | os.PathLike  # the MATH training problems
    completions: Callable[[], Completions] | None = None  # makes the target's completions (self-instruct)
    cache_dir: str | os.PathLike = "."  # self-instruct rounds
    deadline: float | None = None  # time.monotonic() value self-instruct stops at


def refuse_benchmark_file(path: str | os.PathLike) -> None:
    if BENCHMARK_FILE_NAME.search(Path(path).name):
        raise ValueError(f"{path} looks like a benchmark (HumanEval, MBPP or math500); training on it is not allowed")


def read_problems(path: str | os.PathLike) -> list[str]:
    """The `problem` field of every line of a JSONL file."""
    refuse_benchmark_file(path)
    with open(path) as f:
        return [json.loads(line)["problem"] for line in f if line.strip()]


def math_prompts(path: str | os.PathLike, count: int | None) -> list[str]:
    return [problem + MATH_INSTRUCTION for problem in read_problems(path)[:count]]


def source_prompts(spec: SourceSpec, seed: int, inputs: SourceInputs,
                   exclude: frozenset[str] = frozenset()) -> list[str] | None:
    """The source's prompts, the first `count` not in `exclude`; None when self-instruct ran out of time
    (its finished rounds are kept)."""
    offline = {"math": lambda count: math_prompts(inputs.problems, count),
               "code": lambda count: coding_prompts(count, seed),
               "libcode": lambda count: coding_prompts(count, seed, LIBRARY_PACKAGES),
               "general": lambda count: general_prompts(count, seed)}
    if spec.name in offline:
        if not exclude:
            return offline[spec.name](spec.count)
        return [t for t in offline[spec.name](None) if t not in exclude][:spec.count]
    if inputs.completions is None:
        raise ValueError("the selfinstruct source needs the target's completions")
    if spec.count is None:
        raise ValueError("the selfinstruct source needs a count")
    texts = self_instruct_prompts(spec.count, seed, inputs.completions(), inputs.cache_dir, inputs.deadline)
    return None if texts is None else [t for t in texts if t not in exclude]  # written fresh: no pool to skip in


def build_prompts(specs: list[SourceSpec], seed: int, inputs: SourceInputs,
                  exclude: frozenset[str] = frozenset()) -> list[Prompt] | None:
    """The mixed, shuffled list, without the texts in `exclude`; None when the deadline stopped self-instruct."""
    prompts = []
    for spec in specs:
        texts = source_prompts(spec, seed, inputs, exclude)
        if texts is None:
            return None
        if spec.count is not None and len(texts) < spec.count:
            log.warning("source %s yields %d prompts, fewer than the %d asked for", spec.name, len(texts), spec.count)
        prompts += [Prompt(spec.name, t) for t in texts]
    distinct = [prompts[i] for i in unique_texts([p.text for p in prompts], threshold=None)]
    return seeded_order(distinct, seed, "mix")


def recipe_of_sources(specs: list[SourceSpec], seed: int, problems: str | os.PathLike,
                      exclude: list[dict] = ()) -> dict:
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"a source is given twice: {', '.join(map(str, specs))}")
    recipe = {"sources": [str(s) for s in specs], "seed": seed}
    if "math" in names:
        recipe["problems"] = Path(problems).name
    if "libcode" in names:  # the prompts depend on the libraries' source
        recipe["libraries"] = installed_packages(LIBRARY_PACKAGES)
    if exclude:
        recipe["exclude"] = list(exclude)
    return recipe


def read_recipe(path: str | os.PathLike) -> dict:
    """The recipe in a `prompts.recipe.json` (or a bare recipe), to rebuild its list, e.g. to exclude it."""
    data = json.loads(Path(path).read_text())
    recipe = data.get("recipe", data)
    if not isinstance(recipe.get("sources"), list) or not isinstance(recipe.get("seed"), int):
        raise ValueError(f"{path}: not a prompt recipe (needs `sources` and `seed`, as prompts.recipe.json has)")
    if any(SourceSpec.parse(s).name == "selfinstruct" for s in recipe["sources"]):
        raise ValueError(f"{path}: a recipe with the selfinstruct source cannot be rebuilt offline to exclude it")
    return recipe


def recipe_texts(recipe: dict, problems: str | os.PathLike) -> frozenset[str]:
    """Every prompt text the list of `recipe` holds (rebuilt offline; its own exclusions applied)."""
    if recipe.get("problems", Path(problems).name) != Path(problems).name:
        raise ValueError(f"the recipe {recipe} was built from {recipe['problems']}, not {problems}")
    if "libraries" in recipe and recipe["libraries"] != installed_packages(LIBRARY_PACKAGES):
        raise ValueError(f"the recipe's libcode prompts were built from {recipe['libraries']}; this machine has "
                         f"{installed_packages(LIBRARY_PACKAGES)}: rebuild it where those versions are installed")
    inputs = SourceInputs(problems)
    excluded = frozenset().union(*(recipe_texts(r, problems) for r in recipe.get("exclude", ())))
    specs = [SourceSpec.parse(s) for s in recipe["sources"]]
    return frozenset(p.text for p in build_prompts(specs, recipe["seed"], inputs, excluded))


def read_prompt_file(path: str | os.PathLike) -> list[Prompt]:
    """A JSONL of ready prompts: non-empty `prompt` and `domain` on every line."""
    refuse_benchmark_file(path)
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not (isinstance(record.get("prompt"), str) and record["prompt"].strip()
                    and isinstance(record.get("domain"), str) and record["domain"].strip()):
                raise ValueError(f"{path}:{number}: each line needs a non-empty `prompt` and `domain`")
            prompts.append(Prompt(record["domain"], record["prompt"]))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def recipe_of_file(path: str | os.PathLike) -> dict:
    return {"prompts_file": Path(path).name, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def stored_recipe(out_dir: str | os.PathLike) -> dict | None:
    path = Path(out_dir) / RECIPE_FILE
    return json.loads(path.read_text())["recipe"] if path.is_file() else None


def save_prompt_set(out_dir: str | os.PathLike, prompts: list[Prompt], recipe: dict) -> None:
    """Both files, atomically; the recipe last, so a list without its recipe is never taken as finished."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"recipe": recipe, "counts": dict(Counter(p.domain for p in prompts)),
              "python": platform.python_version()}
    for name, text in ((PROMPTS_FILE, "".join(json.dumps({"domain": p.domain, "prompt": p.text}) + "\n"
                                              for p in prompts)),
                       (RECIPE_FILE, json.dumps(record, indent=1) + "\n")):
        tmp = out_dir / f".tmp-{name}"
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)


def load_prompt_set(out_dir: str | os.PathLike) -> list[Prompt]:
    with open(Path(out_dir) / PROMPTS_FILE) as f:
        return [Prompt(r["domain"], r["prompt"]) for r in map(json.loads, f)]


def prompt_set(out_dir: str | os.PathLike, recipe: dict, build: Callable[[], list[Prompt] | None]) -> list[Prompt] | None:
    """The directory's list when it was built from `recipe`; else `build()`'s, stored (None: not finished).
    A directory holding a list of another recipe is refused: its shards answer that list."""
    stored = stored_recipe(out_dir)
    if stored is not None:
        if stored != recipe:
            raise ValueError(f"{out_dir} holds prompts built from {stored}, not {recipe}; use another directory "
                             f"or the same sources and seed")
        return load_prompt_set(out_dir)
    prompts = build()
    if prompts is not None:
        save_prompt_set(out_dir, prompts, recipe)
    return prompts

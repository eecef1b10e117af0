"""math500 evaluation: answer extraction and grading, and the CLI end to end on a tiny random model."""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eval import command, math500
from eval.grading import as_number, last_boxed, normalize, select_grader, strings_match
from eval.problems import HUB, INSTRUCTION, PACKAGED_DATA, DataUnavailable, Problem, load_problems, prompt_ids, select
from eval.runner import run_problems
from specdec import SamplingParams
from specdec.engine.metrics import RequestStats
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter
from tests.eval_helpers import PROBLEMS, importable, refuse_model_loading
from tests.tokenizer_helpers import save_char_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("math500")
    target = root / "target"
    hf = build_tiny_model("qwen2", target)
    save_char_tokenizer(target)
    build_random_drafter(root / "drafter", hf.config, block_size=4)
    data = root / "math500.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return SimpleNamespace(root=root, target=str(target), drafter=str(root / "drafter"), data=str(data))


def run_cli(setup, name, *extra):
    out = setup.root / name
    argv = ["--target", setup.target, "--data", setup.data, "--limit", "2", "--seed", "1", "--max-new-tokens", "16",
            "--device", "cpu", "--num-kv-pages", "32", "--no-progress", "--output", str(out), *extra]
    assert math500.main(argv) == 0
    return out, json.loads((out / "results.json").read_text(encoding="utf-8"))


def check_run(run, n):
    summary = run["summary"]
    assert run["problems"] == n and 0.0 <= run["accuracy"] <= 1.0 and run["errors"] == 0
    assert summary["requests"] == n and summary["tpot_s"] > 0 and summary["tokens_per_s"] > 0
    assert sum(summary["histogram"].values()) == summary["verify_steps"]


@pytest.fixture(scope="module")
def spec_run(setup):
    return run_cli(setup, "spec", "--drafter", setup.drafter, "--baseline")


def test_speculative_with_baseline(spec_run):
    out, res = spec_run
    assert (out / "summary.md").is_file()
    assert (out / "acceptance_histogram.png").is_file() == importable("matplotlib")  # skipped without it
    main, base, comp = res["main"], res["baseline"], res["comparison"]
    check_run(main, 2)
    check_run(base, 2)
    assert main["mode"] == "speculative" and res["config"]["block_size"] == 4
    assert res["config"]["num_problems"] == 2 and res["grader"]["name"] in ("math-verify", "normalized-string")
    assert INSTRUCTION in res["config"]["first_prompt"]
    s = main["summary"]
    assert 1.0 <= s["tau_overall"] <= 4.0 and 1.0 <= s["tau_mean_of_requests"] <= 4.0
    assert len(s["per_position_acceptance"]) == 3
    # every token after the first (which prefill produces) was committed by a verify step; a request's
    # last step may count tokens past its stop point, hence >=
    committed = sum(int(k) * v for k, v in s["histogram"].items())
    assert committed >= sum(p["tokens"] - 1 for p in res["problems"]) > 0
    assert base["summary"]["verify_steps"] == 0
    # greedy speculation on the fp32 torch path is the target's own output, token for token
    assert comp["identical_fraction"] == 1.0 and comp["differing"] == []
    assert comp["accuracy_speculative"] == comp["accuracy_baseline"]
    assert all(p["identical"] and p["first_diff"] is None for p in res["problems"])
    assert [p["id"] for p in res["problems"]] == [PROBLEMS[i]["unique_id"] for i in select(range(3), 2, 1)]
    assert "| accuracy |" in (out / "summary.md").read_text(encoding="utf-8")


def test_batched_speculation_matches_batch_one(setup, spec_run):
    one = spec_run[1]
    _, two = run_cli(setup, "spec-c2", "--drafter", setup.drafter, "--concurrency", "2")
    assert [p["output"] for p in one["problems"]] == [p["output"] for p in two["problems"]]
    assert two["config"]["concurrency"] == 2


def test_without_drafter(setup):
    out, res = run_cli(setup, "ar", "--no-drafter", "--baseline")  # --baseline is moot without a drafter
    check_run(res["main"], 2)
    assert res["main"]["mode"] == "autoregressive" and res["baseline"] is None
    assert res["main"]["summary"]["tau_overall"] is None
    assert not (out / "acceptance_histogram.png").exists() and (out / "summary.md").is_file()


def test_unreachable_hub_points_at_the_shipped_copy(monkeypatch):
    """The hub split is opt-in (--data hub); when it cannot be reached, the error names the offline default."""
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataUnavailable, match="without --data"):
        load_problems(HUB)


def test_subset_is_seeded_and_in_file_order():
    problems = list(range(50))
    a, b = select(problems, 10, seed=3), select(problems, 10, seed=3)
    assert a == b == sorted(a) and len(set(a)) == 10
    assert select(problems, 10, seed=4) != a
    assert select(problems, None, seed=3) == problems and select(problems, 99, seed=3) == problems


def test_prompt_switches_thinking_off_only_where_the_template_has_the_switch():
    class Tok:
        def __init__(self, template):
            self.chat_template, self.seen = template, None

        def apply_chat_template(self, messages, **kwargs):
            self.seen = (messages, kwargs)
            return "x"

        def encode(self, text, add_special_tokens=True):
            return [add_special_tokens]

    plain, qwen3 = Tok("{{ messages }}"), Tok("{% if enable_thinking is defined %}{% endif %}")
    assert prompt_ids(plain, "p") == [False]
    prompt_ids(qwen3, "p")
    assert plain.seen[0] == [{"role": "user", "content": "p" + INSTRUCTION}]
    assert "enable_thinking" not in plain.seen[1] and qwen3.seen[1]["enable_thinking"] is False


def test_last_boxed():
    assert last_boxed("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} then \\boxed{x^{2}+\\sqrt{y}} end") == "x^{2}+\\sqrt{y}"
    assert last_boxed("no box here") is None
    assert last_boxed("\\boxed{3} and a cut-off \\boxed{4") == "3"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed {7}") == "7"


@pytest.mark.parametrize("pred, gold", [
    ("10.0", "10"), ("\\text{(C)}", "C"), ("(C)", "\\text{(C)}"), ("1/2", "\\frac{1}{2}"), ("0.5", "\\dfrac12"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"), ("90^\\circ", "90"), ("1,000", "1000"),
    ("\\$18.90", "18.9"), ("x = 5.", "x=5"), ("\\text{Evelyn}", "Evelyn"), ("-\\frac{3}{4}", "-0.75"),
])
def test_fallback_accepts_equal_answers(pred, gold):
    assert strings_match(pred, gold)


@pytest.mark.parametrize("pred, gold", [("3", "4"), ("\\frac{1}{3}", "0.33"), ("(3,2)", "(2,3)"), ("B", "C"),
                                        ("\\leftarrow", "arrow")])
def test_fallback_rejects_different_answers(pred, gold):
    assert not strings_match(pred, gold)


def test_normalize_and_numbers():
    assert normalize("\\left[ 1, 2 \\right)") == "[1,2)"
    assert as_number("2/0") is None and as_number("x") is None and as_number("-.5") == as_number("-1/2")


def test_grader_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
    grader = select_grader()
    assert grader.name == "normalized-string"
    assert grader.is_correct("10.0", "10") and not grader.is_correct(None, "10") and not grader.is_correct("9", "10")


def test_math_verify_grader():
    pytest.importorskip("math_verify")
    grader = select_grader()
    assert grader.name == "math-verify" and grader.describe()["version"]
    assert grader.is_correct("x^2+1", "1+x^2") and grader.is_correct("[-2, 7)", "[-2,7)")
    assert grader.is_correct("\\text{(C)}", "C") and not grader.is_correct("3", "4")


def test_accuracy_counts_failed_requests_as_wrong():
    class FakeLLM:
        def generate(self, prompts, params, on_finish):
            texts = {1: "so \\boxed{2}", 2: "\\boxed{3}", 3: ""}
            results = [SimpleNamespace(text=texts[p[0]], token_ids=[5, 6], stats=RequestStats(generated_tokens=2),
                                       finish_reason="error" if p[0] == 3 else "stop") for p in prompts]
            for i, result in reversed(list(enumerate(results))):  # finishing order is not prompt order
                on_finish(i, result)
            return results

    problems = [Problem(i, str(i), "q", "2") for i in range(3)]
    run = run_problems(FakeLLM(), problems, [[1], [2], [3]], SamplingParams(), 2, select_grader(), "fake",
                       progress=False)
    assert run.correct == [True, False, False] and run.extracted == ["2", "3", None]
    assert run.errors == 1 and run.summary.requests == 2 and run.accuracy == pytest.approx(1 / 3)


def test_grading_waits_for_the_end_of_the_timed_generation():
    """A grader called as each request finished ran on the engine's thread: it paused every request in flight and
    counted in the generation's wall time (and the TPOT of the requests it paused)."""
    phase = ["before"]

    class FakeLLM:
        def generate(self, prompts, params, on_finish):
            phase[0] = "generating"
            results = [SimpleNamespace(text=f"\\boxed{{{p[0]}}}", token_ids=[5], stats=RequestStats(generated_tokens=1),
                                       finish_reason="stop") for p in prompts]
            for i, result in enumerate(results):
                on_finish(i, result)
            phase[0] = "generated"
            return results

    class RecordingGrader:
        name, metric, grading_threads = "recording", "accuracy", None
        seen: list[str] = []

        def grade(self, problem, text):
            self.seen.append(phase[0])
            return select_grader().grade(problem, text)

    grader = RecordingGrader()
    problems = [Problem(i, str(i), "q", "2") for i in range(3)]
    run = run_problems(FakeLLM(), problems, [[1], [2], [3]], SamplingParams(), 2, grader, "fake", progress=False)
    assert grader.seen == ["generated"] * 3 and run.correct == [False, True, False]


def test_local_jsonl_loads_without_datasets(tmp_path, monkeypatch):
    """A bare GPU image has no `datasets`: a local jsonl still loads, the same as through datasets."""
    rows = [{"problem": "1+1?", "answer": "2", "unique_id": "a"}, {"problem": "2+2?", "answer": "4", "level": 1}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with_datasets = load_problems(str(path))
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    without = load_problems(str(path))
    assert [(p.id, p.problem, p.answer) for p in without] == [("a", "1+1?", "2"), ("1", "2+2?", "4")]
    assert [(p.id, p.problem, p.answer) for p in without] == [(p.id, p.problem, p.answer) for p in with_datasets]
    assert len(load_problems(None)) == 500  # the shipped copy needs no `datasets` either
    with pytest.raises(DataUnavailable, match="datasets"):
        load_problems(HUB)


def test_default_data_is_the_shipped_copy_without_the_hub(monkeypatch):
    """No --data: the 500 problems shipped with the package, read without trying the hub (offline machines)."""
    import datasets

    def hub(*args, **kwargs):
        raise AssertionError("the hub must not be tried by default")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    problems = load_problems(None)
    assert len(problems) == 500 and len({p.id for p in problems}) == 500
    assert problems[0].id.startswith("test/") and problems[0].problem and problems[0].answer
    assert PACKAGED_DATA.is_file() and load_problems(str(PACKAGED_DATA)) == problems


def test_no_message_points_at_a_shared_checkout():
    import eval.problems as problems_module

    for module in (problems_module, math500):
        assert "shared/data" not in Path(module.__file__).read_text(encoding="utf-8")


@pytest.mark.parametrize("content, expected", [
    ("", r"holds no problems"),
    ("\n\n", r"holds no problems"),
    ('{"problem": "a", "answer": "1"}\nnot json\n', r":2: not a JSON"),
    ('{"problem": "a", "answer": "1"}\n{"problem": "b"}\n', r":2: .*missing .*answer"),
    ('{"answer": "1"}\n', r":1: .*missing .*problem"),
    ('[1, 2]\n', r":1: not a JSON object"),
    ('{"problem": "a", "answer": "1"}\n\n{"problem": "", "answer": "2"}\n', r":3: .*empty .*problem"),
])
def test_malformed_data_names_file_and_line(tmp_path, content, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataUnavailable, match=expected) as info:
        load_problems(str(path))
    assert str(path) in str(info.value)


def cli_error(monkeypatch, capsys, argv) -> str:
    refuse_model_loading(monkeypatch)
    assert math500.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("content", ["", "garbage\n", '{"problem": "a"}\n'])
def test_cli_rejects_malformed_data_before_loading_a_model(tmp_path, monkeypatch, capsys, content):
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    err = cli_error(monkeypatch, capsys, ["--data", str(path), "--output", str(tmp_path / "out"), "--no-drafter"])
    assert err.startswith("error: ") and str(path) in err
    assert not (tmp_path / "out").exists()


def test_cli_rejects_missing_data_file(tmp_path, monkeypatch, capsys):
    err = cli_error(monkeypatch, capsys, ["--data", str(tmp_path / "nope.jsonl"), "--no-drafter",
                                          "--output", str(tmp_path / "out")])
    assert str(tmp_path / "nope.jsonl") in err


def test_cli_rejects_output_under_a_file(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "run"
    err = cli_error(monkeypatch, capsys, ["--limit", "1", "--no-drafter", "--output", str(out)])
    assert err.startswith("error: ") and str(out) in err


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root writes into read-only dirs")
def test_cli_rejects_read_only_output(tmp_path, monkeypatch, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        err = cli_error(monkeypatch, capsys, ["--limit", "1", "--no-drafter", "--output", str(ro / "run")])
    finally:
        ro.chmod(0o755)
    assert str(ro / "run") in err


def test_cli_rejects_output_that_is_a_file(tmp_path, monkeypatch, capsys):
    target = tmp_path / "results.txt"
    target.write_text("x")
    err = cli_error(monkeypatch, capsys, ["--limit", "1", "--no-drafter", "--output", str(target)])
    assert str(target) in err


def test_read_only_output_is_detected_even_as_root(tmp_path, monkeypatch):
    """The writability probe writes a file (an access() check passes for root on a read-only mount)."""
    from eval.command import check_output_dir

    calls = []

    def refuse(self, *args, **kwargs):
        calls.append(self)
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(Path, "write_bytes", refuse)
    with pytest.raises(OSError, match="cannot write"):
        check_output_dir(tmp_path / "run")
    assert calls


def test_default_output_is_outside_the_repository(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = command.output_dir(command.parse_args(math500.MATH500, []), math500.MATH500)
    assert out.parent.resolve() == tmp_path.resolve() and out.name.startswith("math500-")
    repo_results = Path(math500.__file__).resolve().parents[1] / "results"
    assert repo_results not in out.resolve().parents
    assert command.output_dir(command.parse_args(math500.MATH500, ["--output", "x/y"]), math500.MATH500) == Path("x/y")

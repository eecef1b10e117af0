"""math500 evaluation: answer extraction and grading, and the CLI end to end on a tiny random model."""

import json
import string
import sys
from types import SimpleNamespace

import pytest

from eval import math500
from eval.grading import as_number, last_boxed, normalize, select_grader, strings_match
from eval.problems import INSTRUCTION, DataUnavailable, Problem, load_problems, prompt_ids, select
from eval.runner import run_problems
from specdec import SamplingParams
from specdec.metrics import RequestStats
from tests.conftest import build_tiny_model
from tests.drafter_helpers import build_random_drafter

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROBLEMS = [
    {"problem": "what is 1+1?", "answer": "2", "unique_id": "test/a/1.json", "subject": "a", "level": 1},
    {"problem": "solve x^2 = 4 for x > 0.", "answer": "2", "unique_id": "test/a/2.json", "subject": "a", "level": 2},
    {"problem": "what is 1/2 + 1/2?", "answer": "1", "unique_id": "test/b/3.json", "subject": "b", "level": 1},
]


def save_char_tokenizer(path):
    """A byte-level tokenizer of single characters (85 ids, inside the tiny model's 96), ChatML-like template.

    Byte-level, because transformers loads a qwen2 model directory's tokenizer as Qwen2Tokenizer,
    which always pre-tokenizes byte-level."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    # ids 0..2 agree with the tiny model's pad / bos / eos ids
    tokens = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>"]
    tokens += [byte_char[ord(c)] for c in string.ascii_letters + string.digits + " \n\\{}$^_()+-=*/.,?"]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


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


def importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


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


def test_missing_hub_data_suggests_local_copy(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataUnavailable, match="--data ../shared/data/math500.jsonl"):
        load_problems(None)


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
    with pytest.raises(DataUnavailable, match="datasets"):
        load_problems(None)

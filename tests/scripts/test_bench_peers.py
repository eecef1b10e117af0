"""scripts/bench_peers.py end to end on CPU with tiny random models: every system runs, the JSON has
finite numbers for each, and greedy speculation (fp32, torch path) reproduces ours-ar token for token."""

import json
import math
from pathlib import Path

import pytest

from scripts.bench import report
from scripts.bench.peers import PEER_SYSTEMS, why_skip_peer
from scripts.bench.systems import dflash_import_error
from scripts.bench_peers import SYSTEMS, main
from tests.conftest import VOCAB, build_tiny_model
from tests.drafter_helpers import build_random_drafter
from tests.eval_helpers import PROBLEMS
from tests.tokenizer_helpers import save_char_tokenizer

ZLAB_MISSING = dflash_import_error()  # the z-lab system is reported as skipped without the dflash package
PEERS_MISSING = {name: why_skip_peer(engine, None) for name, (engine, _) in PEER_SYSTEMS.items()}
SKIPPED = {**{name: why for name, why in PEERS_MISSING.items() if why},
           **({"zlab-dflash": ZLAB_MISSING} if ZLAB_MISSING else {})}
RUN = [s for s in SYSTEMS if s not in SKIPPED]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-peers")
    target = build_tiny_model("qwen2", root / "target")
    save_char_tokenizer(root / "target")
    build_tiny_model("qwen2", root / "assistant", seed=1)
    save_char_tokenizer(root / "assistant")
    build_random_drafter(root / "drafter", target.config, block_size=4, mask_token_id=VOCAB - 1)
    data = root / "math500.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS), encoding="utf-8")
    return root


def run_main(root, name, *extra):
    out = root / f"{name}.json"
    argv = ["--data", str(root / "math500.jsonl"), "--target", str(root / "target"), "--drafter",
            str(root / "drafter"), "--assistant", str(root / "assistant"), "--limit", "2", "--max-new-tokens", "8",
            "--throughput-prompts", "4", "--warmup-tokens", "4", "--num-kv-pages", "64", "--device", "cpu",
            "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def bench_run(tiny):
    return run_main(tiny, "all", "--concurrency", "1,2")


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_every_system_runs_with_finite_numbers(bench_run):
    res = bench_run
    assert list(res["systems"]) == RUN
    assert res["skipped"] == SKIPPED
    assert res["environment"]["torch"] and res["environment"]["device"] == "cpu"
    assert "scripts/bench_peers.py" in res["command_line"] and res["config"]["max_new_tokens"] == 8
    assert [p["index"] for p in res["prompts"]] == [0, 1]
    for name, system in res["systems"].items():
        s = system["summary"]
        assert s["prompts"] == 2 and s["generated_tokens"] > 0, name
        for key in ("tpot_ms_median", "ttft_ms_median", "tokens_per_s", "speedup_vs_hf", "speedup_vs_ours_ar"):
            assert finite(s[key]) and s[key] > 0, (name, key, s[key])
        for record in system["prompts"]:
            assert 1 <= record["generated_tokens"] <= 8 and finite(record["wall_s"])
        if name in ("ours-dflash-bf16", "ours-dflash-auto", "ours-dflash-fp8", "zlab-dflash", "hf-assisted"):
            assert finite(s["tau_mean"]) and 1.0 <= s["tau_mean"] <= 8, (name, s["tau_mean"])
        else:
            assert s["tau_mean"] is None
    assert res["systems"]["ours-ar"]["summary"]["speedup_vs_ours_ar"] == pytest.approx(1.0)
    assert res["systems"]["hf-generate"]["summary"]["speedup_vs_hf"] == pytest.approx(1.0)


def test_outputs_match_autoregressive(bench_run):
    systems = bench_run["systems"]
    ar = [p["token_ids"] for p in systems["ours-ar"]["prompts"]]
    # the model-dtype KV cache (fp32 here, on the torch path): speculation is exact whatever the drafter proposes
    assert [p["token_ids"] for p in systems["ours-dflash-bf16"]["prompts"]] == ar
    assert systems["ours-dflash-bf16"]["summary"]["same_as_ar"]["fraction"] == 1.0
    # the others only report how many match: an fp8 KV cache changes the target's own logits, and the peers
    # run other kernels (greedy near-ties may go either way)
    for name in (s for s in RUN if s not in ("ours-ar", "ours-dflash-bf16")):
        same = systems[name]["summary"]["same_as_ar"]
        # the reported count and fraction are exactly those of the token ids the JSON holds
        identical = sum(p["token_ids"] == a for p, a in zip(systems[name]["prompts"], ar))
        assert same["compared"] == 2 and same["identical"] == identical, name
        assert same["fraction"] == identical / 2 and len(same["differing"]) == 2 - identical, name


def test_throughput_rows(bench_run):
    rows = bench_run["throughput"]
    assert bench_run["throughput_error"] is None
    ours = ("ours-dflash-bf16", "ours-dflash-auto", "ours-ar", "ours-ar-overlapped")
    assert [(r["concurrency"], r["system"]) for r in rows] == [(c, name) for c in (1, 2) for name in ours]
    for r in rows:
        assert r["prompts"] == 4 and r["generated_tokens"] > 0 and finite(r["tokens_per_s"])
        assert finite(r["tpot_ms_mean"])
    assert all(r["same_as_ar"] == "4/4" for r in rows if r["system"] != "ours-ar")


def test_budgets_and_skips(tiny):
    """A spent deadline still gives one timed prompt per system and skips the throughput runs with a note;
    a missing drafter or assistant skips the systems that need one, with the reason."""
    res = run_main(tiny, "budget", "--systems", "ours-ar,ours-dflash-bf16", "--deadline-s", "0.001",
                   "--concurrency", "1")
    assert list(res["systems"]) == ["ours-dflash-bf16", "ours-ar"]
    assert all(s["truncated"] and s["summary"]["prompts"] == 1 for s in res["systems"].values())
    assert res["throughput"] == [] and set(res["throughput_skipped"]) == {"C=1 ours-dflash-bf16", "C=1 ours-ar"}
    res = run_main(tiny, "missing", "--systems", "ours-ar,zlab-dflash,ours-dflash-fp8,hf-assisted", "--drafter",
                   str(tiny / "nowhere"), "--assistant", str(tiny / "no-assistant"), "--concurrency", "none")
    assert list(res["systems"]) == ["ours-ar"]
    assert set(res["skipped"]) == {"zlab-dflash", "ours-dflash-fp8", "hf-assisted"}
    assert "nowhere" in res["skipped"]["ours-dflash-fp8"] and "no-assistant" in res["skipped"]["hf-assisted"]
    assert res["throughput"] == []


def test_report_helpers():
    a = [{"index": 0, "tpot_s": 0.02, "token_ids": [1, 2, 3]}, {"index": 1, "tpot_s": 0.04, "token_ids": [4]}]
    b = [{"index": 0, "tpot_s": 0.01, "token_ids": [1, 2, 4]}]
    assert report.tpot_speedup(a, b) == pytest.approx(2.0)  # over the shared prompt only
    cmp = report.compare_outputs(a, b)
    assert cmp["compared"] == 1 and cmp["identical"] == 0 and cmp["differing"] == [{"index": 0, "first_diff": 2}]
    assert report.first_difference([1, 2], [1, 2, 3]) == 2 and report.first_difference([5], [5]) is None


def test_same_as_ar_fraction_on_constructed_outputs():
    """Two of three shared prompts identical (a fourth only in the reference): fraction exactly 2/3."""
    ar = [{"index": i, "token_ids": ids} for i, ids in enumerate([[1, 2], [3, 4, 5], [6], [7, 8]])]
    other = [{"index": 2, "token_ids": [6]}, {"index": 0, "token_ids": [1, 2]}, {"index": 1, "token_ids": [3, 9, 5]}]
    cmp = report.compare_outputs(ar, other)
    assert cmp["compared"] == 3 and cmp["identical"] == 2 and cmp["fraction"] == pytest.approx(2 / 3)
    assert cmp["differing"] == [{"index": 1, "first_diff": 1}]
    assert report.compare_outputs(ar, [{"index": 0, "token_ids": [2, 1]}])["fraction"] == 0.0
    assert report.compare_outputs(ar, [])["fraction"] is None


FAKE_VLLM = '''"""A stand-in for vLLM's async API, decoding greedily with specdec (what the peer worker calls)."""
import sys
sys.path.insert(0, {root!r})
__version__ = "0.0-test"


class SamplingParams:
    def __init__(self, temperature, max_tokens, stop_token_ids, repetition_penalty):
        self.max_tokens, self.stop_token_ids = max_tokens, stop_token_ids
'''
FAKE_ASYNC_LLM = '''import types
from specdec import LLM, SamplingParams


class AsyncLLM:
    @classmethod
    def from_engine_args(cls, args):
        engine = cls()
        engine.llm = LLM(args.model, device="cpu", num_kv_pages=64)
        return engine

    async def generate(self, prompt, params, request_id):
        [result] = self.llm.generate([prompt["prompt_token_ids"]], SamplingParams(max_new_tokens=params.max_tokens))
        ids = list(result.token_ids)
        for end in (1, len(ids)):  # two chunks, as a streaming engine would send them
            yield types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids[:end])])

    def shutdown(self):
        pass
'''
FAKE_ENGINE_ARGS = '''class AsyncEngineArgs:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
'''


def fake_vllm_site(root):
    """A site directory whose `vllm` is FAKE_VLLM: enough of vLLM's API for scripts/bench/peer_worker.py."""
    site = root / "fake-vllm-site"
    files = {"vllm/__init__.py": FAKE_VLLM.format(root=str(Path(__file__).resolve().parents[2])),
             "vllm/engine/__init__.py": "", "vllm/engine/arg_utils.py": FAKE_ENGINE_ARGS,
             "vllm/v1/__init__.py": "", "vllm/v1/engine/__init__.py": "",
             "vllm/v1/engine/async_llm.py": FAKE_ASYNC_LLM}
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text, encoding="utf-8")
    return site


def test_peer_system_in_its_own_process(tiny):
    """vllm-ar through the real worker process and site-directory plumbing (a stand-in engine that decodes
    greedily with specdec): its batch-1 records and throughput rows land in the JSON, and its outputs are
    counted identical to ours-ar's."""
    site = fake_vllm_site(tiny)
    res = run_main(tiny, "peer", "--systems", "ours-ar,vllm-ar,vllm-dflash", "--concurrency", "2",
                   "--peer-site", f"vllm={site}", "--drafter", str(tiny / "nowhere"))
    assert list(res["systems"]) == ["ours-ar", "vllm-ar"] and "nowhere" in res["skipped"]["vllm-dflash"]
    peer = res["systems"]["vllm-ar"]
    assert peer["info"]["vllm"] == "0.0-test" and peer["info"]["exit"] == 0 and peer["info"]["error"] is None
    assert peer["summary"]["same_as_ar"]["identical"] == 2 and peer["summary"]["tau_mean"] is None
    assert all(finite(r["tpot_s"]) and finite(r["ttft_s"]) for r in peer["prompts"])
    rows = {(r["concurrency"], r["system"]): r for r in res["throughput"]}
    assert set(rows) == {(2, "ours-ar"), (2, "vllm-ar")}
    assert rows[(2, "vllm-ar")]["same_as_ar"] == "4/4" and rows[(2, "vllm-ar")]["generated_tokens"] > 0


def test_peer_failures_are_named(tiny):
    """A peer that is not installed is skipped with the fix; one that dies is reported with its error line."""
    res = run_main(tiny, "no-peer", "--systems", "ours-ar,sglang-ar", "--concurrency", "none",
                   "--peer-site", f"sglang={tiny / 'no-such-site'}")
    assert "no-such-site does not exist" in res["skipped"]["sglang-ar"]
    broken = tiny / "broken-site" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ValueError('Model Qwen2ForCausalLM implements neither')\n")
    res = run_main(tiny, "broken", "--systems", "ours-ar,vllm-ar", "--concurrency", "none",
                   "--peer-site", f"vllm={broken.parent}")
    assert "ValueError: Model Qwen2ForCausalLM implements neither" in res["skipped"]["vllm-ar"]


def test_throughput_comparisons():
    rows = [{"system": s, "concurrency": c, "tokens_per_s": t} for s, c, t in
            [("vllm-dflash", 8, 300.0), ("ours-ar", 8, 50.0), ("vllm-ar", 8, 100.0), ("ours-dflash-bf16", 8, 150.0)]]
    outputs = {("ours-ar", 8): [[1, 2, 9], [3]], ("vllm-ar", 8): [[1, 2], [4]], ("vllm-dflash", 8): [[1, 2, 9], [3, 9]],
               ("ours-dflash-bf16", 8): [[1, 2, 9], [3]]}
    done = report.compare_throughput(rows, outputs, list(SYSTEMS), [8], stop_ids=(9,))
    assert [r["system"] for r in done] == ["ours-dflash-bf16", "ours-ar", "vllm-dflash", "vllm-ar"]
    by = {r["system"]: r for r in done}
    assert by["vllm-dflash"]["speedup_vs_ar"] == pytest.approx(3.0)  # over vLLM's own AR, not ours
    assert by["ours-dflash-bf16"]["speedup_vs_ar"] == pytest.approx(3.0)
    # a final stop token is ignored (engines differ in returning it); anything else must match
    assert by["vllm-ar"]["same_as_ar"] == "1/2" and by["vllm-dflash"]["same_as_ar"] == "2/2"
    assert "same_as_ar" not in by["ours-ar"]

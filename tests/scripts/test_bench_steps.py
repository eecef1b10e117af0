"""scripts/bench_steps.py on CPU: the quick run end to end (tiny random target and drafter), the
weight-byte count of the default target's shape, how kernel times turn into busy % or n/a, how
profiler events are sorted, and the host timers leaving the engine as they found it."""

import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from drafters import DEFAULT_DRAFTERS, resolve_drafter_path
from drafters.dflash_model import read_dflash_config
from drafters.training.drafter_config import parameter_counts
from scripts.bench.random_models import TARGET_SHAPE
import scripts.bench_steps as bench_steps
from scripts.bench_steps import derive, event_kind, host_timers, kernel_name, main, weight_bytes
from specdec.engine import decoding


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-steps") / "steps.json"
    assert main(["--quick", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_quick_run_has_every_row_with_positive_times(quick):
    want = {(system, kv, graphs, batch) for system in ("AR", "DFlash") for graphs in (False, True)
            for kv, batches in (("fp32", (1, 2)), ("fp8", (1,))) for batch in batches}
    rows = quick["rows"]
    assert {(r["system"], r["kv"], r["graphs"], r["batch"]) for r in rows} == want and len(rows) == len(want)
    for r in rows:
        assert r["step_wall_ms"] > 0 and r["tpot_ms"] > 0 and r["bound_ms"] > 0
        assert r["steps"] >= 1 and 1 <= r["tokens_per_step"] <= 4  # the tiny drafter's block is 4
        assert r["kernel_ms"] is None and r["busy_pct"] is None  # no CUDA: n/a, not a number
        assert r["plan_ms"] > 0 and r["transfer_wait_ms"] >= 0  # the torch backend plans on the host too
        assert r["plan_ms"] + r["transfer_wait_ms"] < r["step_wall_ms"] * 1.5
    assert quick["copy_bandwidth"] > 0 and quick["skipped"] is None
    w = quick["weight_bytes"]
    assert w["dflash"] == w["target"] + w["drafter"] + w["lm_head"] and w["drafter"] > 0
    assert set(quick["graph_capture_s"]) == {f"{s} {kv} {g}" for s in ("AR", "DFlash") for kv in ("fp32", "fp8")
                                             for g in ("eager", "graphs")}


def test_weight_bytes_of_the_default_target_shape(tmp_path):
    Qwen2Config(**TARGET_SHAPE).save_pretrained(tmp_path)
    drafter = resolve_drafter_path(DEFAULT_DRAFTERS["qwen2.5-coder-1.5b-instruct"])
    w = weight_bytes(tmp_path, drafter, itemsize=2)
    per_layer = (1536 * 1536 + 1536) + 2 * (1536 * 256 + 256) + 1536 * 1536 + 3 * 1536 * 8960 + 2 * 1536
    lm_head = 151936 * 1536
    assert w["target"] == 2 * (28 * per_layer + 1536 + lm_head)  # no embedding, lm_head once
    assert w["lm_head"] == 2 * lm_head
    # the shipped drafter (stored in fp8 or q4_0) streams its dequantized weights, 2 bytes each
    assert w["drafter"] == 2 * parameter_counts(read_dflash_config(drafter))["total"] > 0
    assert w["dflash"] == w["target"] + w["drafter"] + w["lm_head"]


def test_kernel_time_becomes_busy_share_or_not_available():
    row = derive({"step_wall_ms": 4.0, "kernel_ms": 3.0}, None, bandwidth=2e12, nbytes=2e9)
    assert row["bound_ms"] == pytest.approx(1.0) and row["busy_pct"] == pytest.approx(75.0)
    assert row["wall_over_kernel"] == pytest.approx(4 / 3)
    hidden = derive({"step_wall_ms": 2.0, "kernel_ms": 0.1}, 3.0, bandwidth=2e12, nbytes=2e9)  # graph kernels unseen
    assert hidden["kernel_ms"] is None and hidden["busy_pct"] is None and hidden["kernel_ms_raw"] == 0.1
    assert derive({"step_wall_ms": 2.0, "kernel_ms": 1.8}, 2.0, 2e12, 2e9)["busy_pct"] == pytest.approx(90.0)


def test_event_kinds_without_activity_type():
    """Kineto events of a torch without `activity_type()`: kernels and copies told apart by device and name."""
    event = lambda device, name: SimpleNamespace(device_type=lambda: device, name=lambda: name)  # noqa: E731
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert event_kind(event(cuda, "void gemm_kernel<...>")) == "kernel"
    assert event_kind(event(cuda, "Memcpy DtoD (Device -> Device)")) == "gpu_memcpy"
    assert event_kind(event(cpu, "aten::mm")) == "host"
    assert event_kind(SimpleNamespace(activity_type=lambda: "gpu_memset")) == "gpu_memset"


def test_host_timers_count_plans_and_transfers_and_then_leave_no_trace():
    calls = []

    class Backend:
        def plan(self, layout):
            calls.append(layout)

    backend = Backend()
    llm = SimpleNamespace(engine=SimpleNamespace(runner=SimpleNamespace(attn=backend), drafter=None))
    read = decoding.StepTransfer.read
    with host_timers(llm) as spent:
        backend.plan("layout")
        assert decoding.StepTransfer.read is not read
        assert decoding.to_host(torch.tensor([[1, 2]]), None) == [[1, 2]]
    assert calls == ["layout"] and spent["plan"] > 0 and spent["transfer"] > 0
    assert "plan" not in vars(backend) and decoding.StepTransfer.read is read


def test_the_largest_kernels_per_step_are_the_generates_less_the_prefills(monkeypatch):
    """Per kernel name: the profiled generate's time and launches less the prefill-only generate's, per step,
    largest first (only when asked for)."""
    profiles = {8: (3e-3, 0.0, 4, Counter(gemm=2_400_000, attention=1_000_000, norm=50_000),
                    Counter(gemm=40, attention=36, norm=9)),
                1: (1e-3, 0.0, 1, Counter(gemm=800_000, attention=200_000, norm=10_000),
                    Counter(gemm=8, attention=4, norm=1))}
    monkeypatch.setattr(bench_steps, "device_time", lambda llm, prompts, max_new, cuda: profiles[max_new])
    row = bench_steps.step_kernels(None, [], 8, cuda=True, top=2)
    assert row["top_kernels"] == [["gemm", 400.0, 8.0], ["attention", 200.0, 8.0]]
    assert "top_kernels" not in bench_steps.step_kernels(None, [], 8, cuda=True)
    assert kernel_name(SimpleNamespace(name=lambda: "void flashinfer::Kernel<true, 128>(Params)")) == \
        "void flashinfer::Kernel"


def busy_for_a_while(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_host_functions_are_the_largest_own_and_inclusive_times_per_step():
    """One generate under cProfile: the functions with the most own time, and the project's (this file's
    included) with the most time with their calls', per step of the longest request, largest first."""
    stats = SimpleNamespace(decode_time=1.0, verify_steps=4, generated_tokens=9)

    def generate(prompts, params):
        busy_for_a_while(0.02)
        return [SimpleNamespace(stats=stats)]

    row = bench_steps.host_functions(SimpleNamespace(generate=generate), [[1]], 8, top=3)
    own, inclusive = row["host_functions"], row["host_functions_inclusive"]
    assert len(own) == 3 and len(inclusive) == 3
    assert [us for _, us, _ in own] == sorted((us for _, us, _ in own), reverse=True)
    assert any(name.endswith("(<built-in method time.perf_counter>)") for name, _, _ in own)  # C calls count
    name, us, calls = inclusive[0]  # generate's own (this file's) and busy_for_a_while's, which it calls
    assert name.startswith("test_bench_steps.py:") and us >= 0.02 / 4 * 1e6 * 0.9 and calls == 0.25  # 1 call, 4 steps
    assert not any(name.startswith("~") for name, _, _ in inclusive)  # the project's functions only

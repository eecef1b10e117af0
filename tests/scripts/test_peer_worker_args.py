"""The engine arguments scripts/bench/peer_worker.py gives vLLM, checked against stand-in vLLM modules (the CPU has
no vLLM): its DFlash gets CUDA graphs for a full batch of verifies, a step budget with room for them, and the lower
memory fraction its warm-up needs with such graphs; its plain decoding keeps the job's settings."""

import sys
import types

import pytest

from scripts.bench.peer_worker import VllmPeer


@pytest.fixture
def engine_args(monkeypatch):
    """Stand-in vllm modules; returns the keyword arguments each AsyncEngineArgs was built with."""
    built = []

    class AsyncEngineArgs:
        def __init__(self, **kwargs):
            built.append(kwargs)

    class AsyncLLM:
        @staticmethod
        def from_engine_args(args):
            return object()

    modules = {"vllm": types.ModuleType("vllm"), "vllm.engine.arg_utils": types.ModuleType("vllm.engine.arg_utils"),
               "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm")}
    modules["vllm"].SamplingParams = object
    modules["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs
    modules["vllm.v1.engine.async_llm"].AsyncLLM = AsyncLLM
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return built


def job(drafter, max_num_seqs=256, memory=0.9):
    return {"model": "/target", "drafter": drafter, "block_size": 16, "max_num_seqs": max_num_seqs,
            "max_model_len": 2048, "gpu_memory_utilization": memory, "stop_token_ids": [0]}


@pytest.mark.parametrize("max_num_seqs", [1, 32, 256])
def test_dflash_gets_graphs_for_a_full_batch_of_verifies(engine_args, max_num_seqs):
    VllmPeer(job("/drafter", max_num_seqs))
    args = engine_args[-1]
    assert args["speculative_config"] == {"method": "dflash", "model": "/drafter", "num_speculative_tokens": 15}
    assert args["compilation_config"] == {"max_cudagraph_capture_size": max_num_seqs * 16}
    assert args["max_num_batched_tokens"] == max(8192, max_num_seqs * 16 + 2048)
    assert args["gpu_memory_utilization"] == 0.8


def test_dflash_keeps_a_lower_memory_fraction(engine_args):
    VllmPeer(job("/drafter", memory=0.5))
    assert engine_args[-1]["gpu_memory_utilization"] == 0.5


def test_plain_decoding_keeps_the_jobs_settings(engine_args):
    VllmPeer(job(None))
    args = engine_args[-1]
    assert args["speculative_config"] is None and args["gpu_memory_utilization"] == 0.9
    assert "compilation_config" not in args and "max_num_batched_tokens" not in args

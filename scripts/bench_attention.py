"""Which FlashInfer kernel serves which step: fa2 (split-KV) against fa3 on the step layouts the engine runs.

    python scripts/bench_attention.py [--out attention.json]      # GPU (Hopper: fa3 exists only there)

One attention layer of the default target's shape (12 query heads, 2 KV heads, head dim 128, pages of 16, bf16)
over a paged cache, for layouts the engine plans: a lone request's decode and chain verify on short and long
contexts, a turn whose long prompt the prefix cache holds (a few new tokens over thousands cached), cold
prefills, and steps where a prompt arrives among decoding or verifying requests. Per layout and kernel: the
GPU kernel time of one `run` (the profiler's, a mean over repeats) and the host time of its `plan`; fa2 both with
split-KV (FlashInfer's choice of chunks) and with each request's KV in one piece (`disable_split_kv`, what the
engine plans for steps of 64 requests or more).

    python scripts/bench_attention.py --host-calls [--out host.json]   # the host's side of an eager step's layers

--host-calls instead times the host's work of an eager step's 28 attention calls through the engine's backend (a
step with a prompt chunk attends so between its piecewise graphs): per layer, the wrapper's own `run` against the
kernel call kept from the plan's first run (attention/planned_run.py), median of --repeats steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_attention.py`: the repo's scripts package
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench_steps import event_kind  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 12, 2, 128, 16

# name -> [(query tokens, KV tokens)] per request (the KV includes the queries)
LAYOUTS = {
    "lone decode, 700 context": [(1, 700)],
    "lone decode, 6k context": [(1, 6000)],
    "lone verify of 16, 700 context": [(16, 700)],
    "lone verify of 16, 6k context": [(16, 6000)],
    "cached turn: 40 new over 6k": [(40, 6000)],
    "cached turn: 150 new over 6k": [(150, 6000)],
    "cached turns x8: 100 new over 6k": [(100, 6000)] * 8,
    "cold prefill, 700": [(700, 700)],
    "cold prefill, 6k": [(6000, 6000)],
    "arrival among 64 verifies of 4 (700 context)": [(4, 700)] * 64 + [(200, 200)],
    "arrival among 64 decodes (700 context)": [(1, 700)] * 64 + [(200, 200)],
    "arrival among 256 verifies of 2 (700 context)": [(2, 700)] * 256 + [(300, 300)],
    "64 verifies of 4 (700 context)": [(4, 700)] * 64,
    # contexts spread as math500's at 64 in flight are
    "arrival among 64 verifies of 4 (200-1,500 context)": [(4, 200 + 20 * i) for i in range(64)] + [(200, 200)],
    "arrival among 64 decodes (200-1,500 context)": [(1, 200 + 20 * i) for i in range(64)] + [(200, 200)],
    "64 verifies of 4 (200-1,500 context)": [(4, 200 + 20 * i) for i in range(64)],
    "64 decodes (200-1,500 context)": [(1, 200 + 20 * i) for i in range(64)],
    "128 verifies of 4 (200-1,500 context)": [(4, 200 + 10 * i) for i in range(128)],
    "256 decodes (200-1,500 context)": [(1, 200 + 5 * i) for i in range(256)],
}


def run_layout(flashinfer, requests, backend: str, repeats: int, device, one_piece: bool = False) -> dict:
    q_lens = [q for q, _ in requests]
    kv_lens = [kv for _, kv in requests]
    pages = [(kv + PAGE - 1) // PAGE for kv in kv_lens]
    cache = torch.randn(sum(pages) + 1, 2, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    as_i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    qo_indptr = as_i32([0] + list(torch.tensor(q_lens).cumsum(0)))
    kv_indptr = as_i32([0] + list(torch.tensor(pages).cumsum(0)))
    kv_indices = torch.randperm(sum(pages), dtype=torch.int32).to(device)
    last_page = as_i32([kv - (p - 1) * PAGE for kv, p in zip(kv_lens, pages)])
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    plans = []
    for _ in range(5):
        start = time.perf_counter()
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page, HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, disable_split_kv=one_piece)
        plans.append(time.perf_counter() - start)
    for _ in range(3):
        wrapper.run(q, cache)
    torch.cuda.synchronize()
    # kernel time from the profiler: events around one run would also count the host's launch latency
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            wrapper.run(q, cache)
        torch.cuda.synchronize()
    kernels = [e for e in prof.profiler.kineto_results.events() if event_kind(e) == "kernel"]
    return {"gpu_us": sum(e.duration_ns() for e in kernels) / repeats / 1e3, "plan_us": 1e6 * statistics.median(plans)}


def host_per_layer(requests, kept: bool, repeats: int, device, layers: int = 28) -> float:
    """Host microseconds per layer of an eager step's attention calls through the backend (the layers' kernels are
    queued, not waited for: the host issues them faster than the GPU runs them)."""
    from dataclasses import replace

    from attention.batch_layout import BatchLayout
    from attention.flashinfer_backend import FlashInferBackend
    from attention.kv_cache import KVCache

    q_lens, kv_lens = [q for q, _ in requests], [kv for _, kv in requests]
    tables, first = [], 0
    for kv in kv_lens:
        tables.append(list(range(first, first + -(-kv // PAGE))))
        first += len(tables[-1])
    layout = replace(BatchLayout.for_tokens(q_lens, kv_lens, tables, PAGE, causal=True), prompts=1)
    backend = FlashInferBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, device=device,
                                kv_dtypes=(torch.bfloat16,), q_dtype=torch.bfloat16)
    cache = KVCache(layers, first + 1, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    times = []
    for _ in range(repeats + 3):
        backend.plan(layout, write_slots=False)
        if not kept:
            backend.planned_runs = None  # every layer through the wrapper's run
        torch.cuda.synchronize()
        start = time.perf_counter()
        for layer in cache.layers:
            backend.attend(q, layer, out=out)
        times.append((time.perf_counter() - start) / layers)
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times[3:])


def host_calls(args, device) -> int:
    import flashinfer

    rows = []
    print("| layout | host us per layer: run | kept call | kept / run |\n|---|---|---|---|")
    for name in ("arrival among 64 verifies of 4 (200-1,500 context)", "arrival among 64 decodes (200-1,500 context)",
                 "arrival among 256 verifies of 2 (700 context)", "cold prefill, 700"):
        run_us, kept_us = [], []
        for _ in range(2):  # alternating, the lower of two each: the host's speed drifts
            run_us.append(host_per_layer(LAYOUTS[name], False, args.repeats, device))
            kept_us.append(host_per_layer(LAYOUTS[name], True, args.repeats, device))
        rows.append({"layout": name, "run_us": run_us, "kept_us": kept_us})
        print(f"| {name} | {min(run_us):.1f} | {min(kept_us):.1f} | {min(kept_us) / min(run_us):.2f} |", flush=True)
    if args.out:
        versions = {"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
                    "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({**versions, "host_calls": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--host-calls", action="store_true", help="the host's work of an eager step's attention calls")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    import flashinfer

    device = torch.device("cuda")
    if args.host_calls:
        return host_calls(args, device)
    rows = []
    print("| layout | fa2 us (plan us) | fa2 in one piece us (plan us) | fa3 us (plan us) | fa2 / fa3 |\n"
          "|---|---|---|---|---|")
    for name, requests in LAYOUTS.items():
        fa2 = run_layout(flashinfer, requests, "fa2", args.repeats, device)
        whole = run_layout(flashinfer, requests, "fa2", args.repeats, device, one_piece=True)
        fa3 = run_layout(flashinfer, requests, "fa3", args.repeats, device)
        rows.append({"layout": name, "requests": requests, "fa2": fa2, "fa2_one_piece": whole, "fa3": fa3})
        cells = [f"{r['gpu_us']:.1f} ({r['plan_us']:.0f})" for r in (fa2, whole, fa3)]
        print(f"| {name} | {' | '.join(cells)} | {fa2['gpu_us'] / fa3['gpu_us']:.2f} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
                                              "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

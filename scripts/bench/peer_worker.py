"""One peer serving engine (vLLM or SGLang) timed on a job, in a process of its own.

    python scripts/bench/peer_worker.py JOB.json RESULT.json

Run by `scripts/bench/peers.py` with the peer's own site directory first on PYTHONPATH (each peer pins
its own flashinfer, transformers, ...), so this file imports nothing of specdec. The job gives the
target and drafter directories, the prompt token ids, max new tokens, stop token ids and concurrency
levels; the result holds per-prompt batch-1 records, throughput rows and the engine's own acceptance
length, in the shapes `scripts/bench/report.py` reads.

Both peers run their asynchronous engine in this process (the offline Python API, no HTTP), greedy, no
prefix caching, their model's generation_config ignored. A request streams its output and is timed
on arrival of each chunk:
- TTFT = first chunk with generated tokens - submit; TPOT = (last chunk - first chunk) / (tokens after
  the first chunk), the formula the other systems use (prefill excluded);
- concurrency C: at most C requests in flight (a semaphore, as `vllm bench serve --max-concurrency`),
  all prompts of the throughput batch; tokens/s = generated tokens / wall seconds.
Acceptance length as each peer reports it: vLLM 1 + accepted / drafts from its Prometheus counters
(over each phase); SGLang the mean over requests of `meta_info["spec_accept_length"]`
(completion tokens / verify steps).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field


@dataclass
class Stream:
    """Arrival times of one request's streamed chunks and its final token ids."""
    submitted: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens generated so far)
    token_ids: list[int] = field(default_factory=list)
    accept_length: float | None = None

    def seen(self, tokens_so_far: int) -> None:
        if tokens_so_far > (self.chunks[-1][1] if self.chunks else 0):
            self.chunks.append((time.perf_counter(), tokens_so_far))

    def record(self, prompt_tokens: int) -> dict:
        ttft = tpot = None
        end = self.chunks[-1][0] if self.chunks else time.perf_counter()
        if self.chunks:
            first_time, first_count = self.chunks[0]
            ttft = first_time - self.submitted
            after = len(self.token_ids) - first_count
            tpot = (end - first_time) / after if after > 0 else None
        return {"token_ids": list(self.token_ids), "prompt_tokens": prompt_tokens, "wall_s": end - self.submitted,
                "ttft_s": ttft, "tpot_s": tpot, "tau": self.accept_length, "target_forwards": None,
                "generated_tokens": len(self.token_ids)}


# ---- vLLM ------------------------------------------------------------------------------------------
class VllmPeer:
    name = "vllm"

    def __init__(self, job: dict):
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        spec, verify_sized, memory = None, {}, job["gpu_memory_utilization"]
        if job["drafter"]:
            spec = {"method": "dflash", "model": job["drafter"], "num_speculative_tokens": job["block_size"] - 1}
            full_verify = job["max_num_seqs"] * job["block_size"]  # tokens of a step verifying every request's block
            # vLLM reserves each running request's draft slots out of a step's token budget and refuses to start
            # when they exceed it (the default budget, 2,048 tokens here, at 256 requests): room for them and
            # 2,048 prompt tokens, at least 8,192. It captures CUDA graphs for steps of up to 512 tokens by default
            # and runs larger steps without them; a verify of block_size tokens a request passes that at 33
            # requests, and from 64 up its DFlash then ran below its own plain decoding (BENCHMARKS.md, 2026-11-26
            # and 2026-12-07): graphs for every step a full batch of verifies can make
            verify_sized = {"max_num_batched_tokens": max(8192, full_verify + 2048),
                            "compilation_config": {"max_cudagraph_capture_size": full_verify}}
            # Its warm-up then samples a step of that many tokens after the KV cache has taken its share, and its
            # memory profile leaves that out: at 0.9 of an H100 it ran out of memory on the 1.16 GiB of logits of
            # 4,096 rows, at 0.8 it ran (2026-12-07)
            memory = min(memory, 0.8)
        args = AsyncEngineArgs(model=job["model"], dtype="bfloat16", seed=0, max_num_seqs=job["max_num_seqs"],
                               max_model_len=job["max_model_len"], enable_prefix_caching=False,
                               gpu_memory_utilization=memory, speculative_config=spec,
                               generation_config="vllm", disable_log_stats=False, **verify_sized)
        self.engine = AsyncLLM.from_engine_args(args)
        self.sampling = lambda n: SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=job["stop_token_ids"],
                                                 repetition_penalty=1.0)
        self.speculative = spec is not None
        self.count = 0

    async def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Stream:
        self.count += 1
        stream = Stream(time.perf_counter())
        async for out in self.engine.generate({"prompt_token_ids": prompt_ids}, self.sampling(max_new_tokens),
                                              f"r{self.count}"):
            completion = out.outputs[0]
            stream.seen(len(completion.token_ids))
            stream.token_ids = list(completion.token_ids)
        return stream

    def event_loop(self):
        return asyncio.new_event_loop()

    def counters(self) -> tuple[float, float] | None:
        """(drafts, accepted tokens) so far, from vLLM's Prometheus counters."""
        if not self.speculative:
            return None
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

        totals = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
        for metric in get_metrics_snapshot():
            if isinstance(metric, Counter) and metric.name in totals:
                totals[metric.name] += metric.value
        return totals["vllm:spec_decode_num_drafts"], totals["vllm:spec_decode_num_accepted_tokens"]

    def info(self) -> dict:
        import vllm

        return {"engine": "vllm", "vllm": vllm.__version__}

    def close(self) -> None:
        self.engine.shutdown()


# ---- SGLang ----------------------------------------------------------------------------------------
class SglangPeer:
    name = "sglang"

    def __init__(self, job: dict):
        import sglang

        kwargs = {}
        if job["drafter"]:
            kwargs = dict(speculative_algorithm="DFLASH", speculative_draft_model_path=job["drafter"],
                          speculative_num_draft_tokens=job["block_size"])
        self.engine = sglang.Engine(model_path=job["model"], dtype="bfloat16", random_seed=0,
                                    mem_fraction_static=job["gpu_memory_utilization"],
                                    max_running_requests=job["max_num_seqs"], context_length=job["max_model_len"],
                                    disable_radix_cache=True, log_level="error", **kwargs)
        self.stop = job["stop_token_ids"]
        self.speculative = bool(job["drafter"])

    async def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Stream:
        stream = Stream(time.perf_counter())
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "stop_token_ids": self.stop,
                  "skip_special_tokens": False}
        final = None
        async for chunk in await self.engine.async_generate(input_ids=prompt_ids, sampling_params=params, stream=True):
            stream.seen(int(chunk["meta_info"]["completion_tokens"]))
            final = chunk
        stream.token_ids = list(final["output_ids"]) if final is not None else []
        if self.speculative and final is not None:
            stream.accept_length = final["meta_info"].get("spec_accept_length")
        return stream

    def event_loop(self):
        return self.engine.loop  # made (and set current) by sglang.Engine

    def counters(self):
        return None  # per request, in Stream.accept_length

    def info(self) -> dict:
        import sglang

        return {"engine": "sglang", "sglang": sglang.__version__}

    def close(self) -> None:
        self.engine.shutdown()


PEERS = {"vllm": VllmPeer, "sglang": SglangPeer}


# ---- the job ---------------------------------------------------------------------------------------
def phase_tau(peer, before, records: list[dict]) -> float | None:
    """The acceptance length the peer reports over a phase (None without speculation)."""
    after = peer.counters()
    if before is not None and after is not None:
        drafts, accepted = after[0] - before[0], after[1] - before[1]
        return 1.0 + accepted / drafts if drafts > 0 else None
    values = [r["tau"] for r in records if r["tau"] is not None]
    return statistics.fmean(values) if values else None


async def batch1(peer, job: dict, deadline: float) -> tuple[list[dict], float | None]:
    await peer.generate(job["warm_prompt"], job["warmup_tokens"])
    before, records = peer.counters(), []
    for index, ids in enumerate(job["prompts"]):
        if records and time.perf_counter() + statistics.fmean(r["wall_s"] for r in records) > deadline:
            log(f"batch 1: time budget reached after {len(records)} prompt(s)")
            break
        stream = await peer.generate(ids, job["max_new_tokens"])
        records.append({"index": index, **stream.record(len(ids))})
        r = records[-1]
        log(f"batch 1 {index + 1}/{len(job['prompts'])}: {r['generated_tokens']} tokens, "
            f"TPOT {(r['tpot_s'] or 0) * 1e3:.2f} ms")
    return records, phase_tau(peer, before, records)


async def at_concurrency(peer, job: dict, concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def one(ids):
        async with gate:
            return (await peer.generate(ids, job["max_new_tokens"])).record(len(ids))

    await asyncio.gather(*(one(job["warm_prompt"]) for _ in range(min(concurrency, len(job["batch"])))))
    before = peer.counters()
    start = time.perf_counter()
    records = await asyncio.gather(*(one(ids) for ids in job["batch"]))
    wall = time.perf_counter() - start
    generated = sum(r["generated_tokens"] for r in records)
    tpots = [r["tpot_s"] for r in records if r["tpot_s"]]
    return {"concurrency": concurrency, "prompts": len(records), "generated_tokens": generated, "wall_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else None,
            "tpot_ms_mean": statistics.fmean(tpots) * 1e3 if tpots else None,
            "tau": phase_tau(peer, before, records), "token_ids": [r["token_ids"] for r in records],
            "per_request": [{k: r[k] for k in ("generated_tokens", "tpot_s", "ttft_s")} for r in records]}


async def measure(peer, job: dict, result: dict, save, deadline: float) -> None:
    result["prompts"], result["tau_reported"] = await batch1(peer, job, deadline)
    save()
    for concurrency in job["concurrency"]:
        if time.perf_counter() > deadline:
            result["throughput_skipped"][str(concurrency)] = "time budget reached"
            continue
        row = await at_concurrency(peer, job, concurrency)
        result["throughput"].append(row)
        log(f"concurrency {concurrency}: {row['generated_tokens']} tokens in {row['wall_s']:.2f} s, "
            f"{row['tokens_per_s']:.1f} tok/s")
        save()


def run_job(job: dict, result: dict, save) -> None:
    """Built outside any event loop: SGLang's Engine makes its own loop, which its async calls must run on."""
    started = time.perf_counter()
    peer = PEERS[job["engine"]](job)
    try:
        result["info"] = {**peer.info(), "build_s": time.perf_counter() - started}
        deadline = started + job["budget_s"] if job.get("budget_s") else float("inf")
        loop = peer.event_loop()
        loop.run_until_complete(measure(peer, job, result, save, deadline))
    finally:
        peer.close()


def log(message: str) -> None:
    print(f"[peer] {message}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    job_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    result = {"info": None, "prompts": [], "tau_reported": None, "throughput": [], "throughput_skipped": {},
              "error": None}

    def save():
        with open(result_path, "w", encoding="utf-8") as f:
            json.dump(result, f)

    try:
        run_job(job, result, save)
    except Exception as err:  # reported in the result; the parent decides what it means
        traceback.print_exc()
        result["error"] = f"{type(err).__name__}: {err}"
    save()
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the result is written: leave without joining the engines' leftover threads and tasks (a vLLM engine
    # shut down from here can keep the interpreter from exiting)
    os._exit(code)

"""The engine's Prometheus metrics (`/metrics`), fed by the engine loop after every step and request.

Names follow vLLM's where one exists (`vllm:` -> `specdec_`); acceptance length = tokens committed per
verify step, bonus included (so 1 + accepted drafts), the same quantity the library reports as tau.
Each server has its own registry (no global state: several servers can live in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdec.engine.engine import Engine, StepOutput
from specdec.engine.request import Request

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, block_size: int = 0):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=registry)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens committed", registry=registry)
        self.preemptions = Counter("specdec_preemptions", "Requests preempted (pages given back, recomputed later)",
                                   registry=registry)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Per request: decode time / (tokens - 1)",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=registry)
        self.step_time = Histogram("specdec_step_seconds", "Engine step time", buckets=LATENCY_BUCKETS,
                                   registry=registry)
        self.acceptance = Histogram("specdec_acceptance_length", "Tokens committed per verify step (bonus included)",
                                    buckets=tuple(range(1, max(block_size, 1) + 1)), registry=registry)
        self.draft_tokens = Counter("specdec_spec_decode_draft_tokens", "Draft tokens proposed", registry=registry)
        self.accepted_tokens = Counter("specdec_spec_decode_accepted_tokens", "Draft tokens accepted",
                                       registry=registry)
        self.kv_pages_in_use = Gauge("specdec_kv_pages_in_use", "KV pages held by requests", ["cache"],
                                     registry=registry)
        self.kv_pages_total = Gauge("specdec_kv_pages_total", "KV pages in the pool", ["cache"], registry=registry)
        # prefix cache hit rate = hits / queries: prompt tokens of finished requests that were admitted
        self.prefix_queries = Counter("specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("specdec_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=registry)
        self.prefix_cached_pages = Gauge("specdec_prefix_cache_pages", "Pages the prefix cache holds an entry for",
                                         registry=registry)
        self.waiting = Gauge("specdec_requests_waiting", "Requests queued (preempted ones included)",
                             registry=registry)
        self.running = Gauge("specdec_requests_running", "Requests in the running batch", registry=registry)
        self._seen_steps: dict[int, int] = {}  # request id -> verify steps already observed

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_pools(self, engine: Engine) -> None:
        pools = {"target": engine.pool}
        if getattr(engine.drafter, "pool", None) is not None:
            pools["drafter"] = engine.drafter.pool
        for name, pool in pools.items():
            self.kv_pages_total.labels(name).set(pool.num_pages)
            self.kv_pages_in_use.labels(name).set(pool.num_pages - pool.num_free)
        self.waiting.set(len(engine.scheduler.waiting))
        self.running.set(len(engine.scheduler.running))
        cache = engine.prefix_cache
        if cache is not None:
            self.prefix_cached_pages.set(cache.num_cached)

    # ---- called by the engine loop after each step and request -----------------------------------
    def on_step(self, engine: Engine, out: StepOutput, seconds: float) -> None:
        self.step_time.observe(seconds)
        self.preemptions.inc(len(out.preempted))
        self.generation_tokens.inc(sum(len(tokens) for _, tokens in out.committed))
        for request, _ in out.committed:
            self._observe_acceptance(request)
        self.observe_pools(engine)

    def on_finish(self, request: Request) -> None:
        self._observe_acceptance(request)
        self._seen_steps.pop(request.request_id, None)
        stats = request.stats
        self.requests.labels(request.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        if stats.cached_tokens is not None:  # looked up at admission (a prefix cache is on)
            self.prefix_queries.inc(stats.prompt_tokens)
            self.prefix_hits.inc(stats.cached_tokens)
        if stats.ttft is not None:
            self.ttft.observe(stats.ttft)
        if stats.tpot is not None:
            self.tpot.observe(stats.tpot)
        if stats.finish_time is not None:
            self.e2e.observe(stats.finish_time - stats.arrival_time)

    def _observe_acceptance(self, request: Request) -> None:
        lengths = request.stats.acceptance_lengths
        seen = self._seen_steps.get(request.request_id, 0)
        for length in lengths[seen:]:
            self.acceptance.observe(length)
            self.draft_tokens.inc(request.stats.block_size - 1)
            self.accepted_tokens.inc(length - 1)
        self._seen_steps[request.request_id] = len(lengths)

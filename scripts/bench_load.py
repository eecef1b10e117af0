"""Throughput under load, and where its time goes: delivered tokens/s, the decode-only step time and
batch, and the share of wall time spent in steps that prefill, for plain decoding and DFlash.

    python scripts/bench_load.py --model NAME --drafter PATH --out load.json   # GPU
    python scripts/bench_load.py --quick --out /tmp/load.json                  # CPU smoke run, tiny model

Each concurrency runs the same requests through the library: --requests chat prompts alternating
math500 problems and everyday coding requests (scripts/bench/chat_prompts.py; --dataset mixed|math500|code
takes scripts/bench_serve.py's prompts instead, the same ones in the same order), --max-new-tokens each,
greedy, answers of their natural length, with `max_num_seqs` = the concurrency, so arrivals keep
coming while others decode. Every
`Engine.step()` is timed and split by whether it prefilled (a prompt chunk of an admitted request); the JSON keeps
every step of each row (`LoadRow.steps`: its kind, batch, wall time, tokens verified, the overheads `auto` had
learned, tokens committed, the switch costs learned), so a level whose tokens/s moves between runs can be traced to
the steps that took the time. The output ends with the decode-only steps summed by batch range and kind of step
(`scripts/bench/step_trace.py`): what each kind delivered per request per ms at each batch.
Single runs of a level vary by 10-16% on a GPU (host-bound steps): --repeats N runs each level N times on
the same engine and reports the run with the median tokens/s. Every run starts from an empty prefix cache
(`LLM.reset_prefix_cache`), so its prompts prefill as on a fresh engine, but for what they share among themselves
(each row's `prompt tokens cached`); --keep-prefix-cache lets a run find what earlier runs of the same prompts left
there (their steps with prefill then cost less, and by how much varies), --no-prefix-caching prefills every prompt
whole. A shared machine also has slow periods of seconds
that slow every system alike (plain decoding's steps too), so systems run one after the other do not compare:
--interleave builds every system's engine first (the GPU memory split between them) and runs each level's rounds
system after system (A B A B ...); each row then also gives its tokens/s over the first system's in each round, whose
median compares the systems within the same seconds, and what its decode-only steps of at least half the concurrency
delivered a request a ms over the first system's (`step_trace.load_rate`): a level's tokens/s also counts the tail its
last requests decode in fewer company, where speculation gains most, and long answers lengthen that tail. Such
periods can also last a whole process: each row's `host probe us` times a fixed Python workload on the host just before
and after its run (`scripts/bench/host_speed.py`), to tell the rows run on a slowed host from the others.

--profile C adds one level at concurrency C under the torch profiler (not counted in the table above):
for steps with prefill and decode-only ones (a drafter's split into plain and speculative steps), the median wall
time against the GPU's busy time in the step (kernels, copies and sets that start inside the step's host range; a
step ends with its device-to-host transfer, so its work has run by then), which says how host-bound each kind of
step is, and the kernels that took most of it. --host-profile C adds one under cProfile, each step profiled apart: per
kind of step, its median wall time and the host functions that took most of it (`scripts/bench/host_profile.py`'s
lists; a wait for the GPU shows as the call that blocks), so steps with prefill and decode-only ones are told apart,
and where each kind of step waited for the GPU (`scripts/bench/host_waits.py` with sites: the event waits by call
site, and on CUDA the torch calls that waited by themselves).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_load.py`: the repo's packages and scripts.bench
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench.chat_prompts import load_prompts, system_prompt, take  # noqa: E402
from scripts.bench.random_models import TINY_SHAPE, random_target, tiny_drafter  # noqa: E402
from scripts.bench.runner import environment, release_memory  # noqa: E402
from scripts.bench.step_trace import load_rate, prompt_step_table, trace_bins, trace_table  # noqa: E402
from scripts.bench.gpu_profile import range_activity, top_kernels  # noqa: E402
from scripts.bench.host_profile import per_step, tables  # noqa: E402
from scripts.bench.host_speed import probe_us  # noqa: E402
from scripts.bench.host_waits import HostWaits  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.engine.verify_policy import TREE, Budget  # noqa: E402


OVERLAPPED = "AR overlapped"  # plain decoding with overlapped steps (--overlap-steps)
# by verify policy (--verify); "budget": auto with its budget steps (`budget_steps`); "in-order": auto with every
# batch's verify planned after its step's tokens are read (`verify_ahead_batches="off"`)
DFLASH = {"chain": "DFlash", "auto": "DFlash auto", "tree": "DFlash tree", "budget": "DFlash auto+budgets",
          "in-order": "DFlash auto, verifies in order"}
SETTINGS = {"budget": {"verify": "auto", "budget_steps": True},
            "in-order": {"verify": "auto", "verify_ahead_batches": "off"}}
AHEAD = ", drafted ahead"  # a DFlash row's suffix with --overlap-steps: each step's next draft queued early


@dataclass
class LoadRow:
    system: str  # "AR" or "DFlash"
    concurrency: int
    requests: int
    tokens: int  # generated tokens delivered
    wall_s: float
    tokens_per_s: float
    decode_steps: int  # steps without a prefill
    decode_step_ms: float  # their median
    decode_batch: float  # their mean batch
    prefill_steps: int
    prefill_step_ms: float  # median of the steps that prefilled
    prefill_share: float  # of the wall time, in steps that prefilled
    tau: float | None
    verified: float | None = None  # tokens verified per request per speculative step (the anchor included)
    runs_tokens_per_s: list[float] | None = None  # with --repeats: every run's, the row being the median run's
    # with --interleave: each round's tokens/s over the first system's in the same round (the run just before it)
    paired: list[float] | None = None
    plain_steps: int | None = None  # DFlash: steps `auto` ran as plain decoding steps (no draft pays at their batch)
    # every step in order: [prompt chunks in it (0/1), decoding requests, wall ms, tokens verified per request (1: a
    # plain step; None: plain decoding's engine, or no request decoding), the speculative and plain overheads `auto`
    # had learned for that batch after the step (ms), tokens committed in the step (an overlapped step commits the
    # tokens of the one before it), the costs of switching to speculation and to plain steps `auto` had learned (ms),
    # the time the host waited for the GPU in the step (ms; ~0: a host-bound step, scripts/bench/host_waits.py), what a
    # speculative step verified ("chain 4", "budget 8/5", "tree"; None otherwise)]: where a level's time went, what it
    # delivered, and what the policy saw
    steps: list[list] | None = None
    started: float | None = None  # unix time the level began (to set it against machine logs, e.g. GPU clocks)
    # of the prompt tokens, the share the prefix cache held at admission (not prefilled): runs of the same prompts on
    # one engine find what earlier runs left cached, as much as the decoding in between did not evict, so their steps
    # with prefill differ (a burst's prompts in one step or two)
    cached_share: float | None = None
    # the host's speed just before and just after the level (scripts/bench/host_speed.py: microseconds of a fixed
    # Python workload, higher is slower), to tell rows run on a slowed host from the others
    host_probe_us: list[float] | None = None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="demo name or HF model directory (--quick: a tiny random one)")
    p.add_argument("--drafter", help="DFlash drafter for the DFlash rows (omit: plain decoding only)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--rounds", type=int, help="run at most rounds x concurrency of the requests at each "
                                              "concurrency (low concurrencies in bounded time; default: all)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1, help="runs of each level on the same engine; the row is the run "
                   "with the median tokens/s (odd counts: the middle one), every run's tokens/s listed beside it")
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"), help="the target's KV cache")
    p.add_argument("--verify", nargs="+", choices=tuple(DFLASH), default=["auto"],
                   help="the DFlash rows' verify policies (a row each; default: auto, the engine's; budget: auto "
                        "with budget steps; in-order: auto without batches' verifies queued ahead)")
    p.add_argument("--dataset", default="chat", choices=("chat", "mixed", "math500", "code"),
                   help="chat: math500 and coding requests alternating; the others: bench_serve.py's prompts")
    p.add_argument("--system-repeat", type=int, default=0,
                   help="each prompt under this many copies of the multiturn set's system prompt (~500 tokens each)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="the engines without a prefix cache: every run prefills its prompts whole")
    p.add_argument("--keep-prefix-cache", action="store_true",
                   help="runs find what earlier runs of the same prompts left in the prefix cache (default: each run "
                        "starts from an empty cache, as on a fresh engine)")
    p.add_argument("--draft-window", type=int, default=None,
                   help="the DFlash rows' draft_window (default: the drafter's declared window; 0: whole context)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="the DFlash rows' draft_vocab (default: the engine's, 0: the whole vocabulary)")
    p.add_argument("--overlap-steps", nargs="?", const="both", default="on", choices=("off", "both", "on"),
                   help="plain decoding with overlapped steps (rows 'AR overlapped') and DFlash drafting ahead "
                        "(rows 'DFlash ..., drafted ahead'), the engine's defaults: alone ('on', the default), beside "
                        "the in-order rows (alone as a flag, or 'both'), or in-order rows only ('off')")
    p.add_argument("--interleave", action="store_true",
                   help="every engine built first (GPU memory split between them); each level's --repeats rounds run "
                        "the systems in turn, and rows give their tokens/s over the first system's, round by round")
    p.add_argument("--profile", type=int, metavar="C", help="one more level at concurrency C under the profiler: "
                                                            "wall vs GPU busy time per kind of step")
    p.add_argument("--host-profile", type=int, metavar="C", help="one more level at concurrency C under cProfile: "
                   "the host functions per kind of step, and where it waited for the GPU")
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes (overrides the above)")
    p.add_argument("--out", help="JSON results file")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.system_repeat < 0 or any(v is not None and v < 0 for v in (args.draft_window, args.draft_vocab)):
        p.error("--system-repeat, --draft-window and --draft-vocab must not be negative")
    if args.quick:
        args.concurrency, args.requests, args.max_new_tokens, args.device = [1, 4], 6, 8, "cpu"
    return args


def chat_prompts(llm: LLM, count: int, dataset: str = "chat", system_repeat: int = 0) -> list[list[int]]:
    """`count` prompts through the model's chat template: alternating math500 and coding requests ("chat"), or
    the first `count` of scripts/bench_serve.py's dataset (its seed 0, one user turn each); with system_repeat,
    each under that many copies of the multiturn set's system prompt (long contexts)."""
    if dataset == "chat":
        math, code = load_prompts("math500", seed=0), load_prompts("code", seed=0)
        chosen = [p for pair in zip(take(math, count), take(code, count)) for p in pair][:count]
    else:
        chosen = take(load_prompts(dataset, seed=0), count)
    system = [{"role": "system", "content": system_prompt(system_repeat)}] if system_repeat else []
    return [llm.encode_chat(system + [{"role": "user", "content": p.text}]) for p in chosen]


def random_prompts(vocab_size: int, count: int) -> list[list[int]]:
    """Seeded random ids of 8-40 tokens (the --quick model has no chat template)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size - 3, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def timed_steps(engine, waits: HostWaits) -> list[tuple]:
    """From now on, record (prefilled, decoding batch, seconds, tokens verified per request, learned overheads, tokens
    committed, learned switch costs, seconds the host waited for the GPU while `waits` counts, the speculative step's
    kind, prompt tokens the step ran, requests it admitted) of every engine step (each step is also a profiler range
    named STEP_RANGE); verified, overheads and switch costs None without a drafter, the kind None but for speculative
    steps."""
    records, schedule, step = [], engine.scheduler.schedule, engine.step
    plans = []
    decoding = engine.decoding if engine.drafter is not None else None

    def recording_schedule(**kwargs):
        plans.append(schedule(**kwargs))
        return plans[-1]

    def timed_step(*args, **kwargs):
        start, waited = time.perf_counter(), waits.seconds
        with torch.profiler.record_function(STEP_RANGE):
            out = step(*args, **kwargs)
        seconds = time.perf_counter() - start
        plan = plans.pop()
        verified = overheads = switches = kind = None
        if decoding is not None and plan.decode:
            verified, overheads = decoding.verify_length, decoding.policy.overheads_at(len(plan.decode))
            switches = decoding.policy.switch_cost(False), decoding.policy.switch_cost(True)
            kind = option_label(decoding.option) if verified != 1 else None
        records.append((bool(plan.prefill), len(plan.decode), seconds, verified, overheads,
                        sum(len(tokens) for _, tokens in out.committed), switches, waits.seconds - waited, kind,
                        sum(n for _, n in plan.prefill), len(plan.admitted)))
        return out

    engine.scheduler.schedule, engine.step = recording_schedule, timed_step
    return records


def run_load(llm: LLM, system: str, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
             cold: bool = False) -> LoadRow:
    """One run of `prompts` at `concurrency`; `cold`: from an empty prefix cache."""
    if cold:
        llm.reset_prefix_cache()
    engine = llm.engine
    engine.scheduler.max_num_seqs = concurrency
    waits = HostWaits()
    records = timed_steps(engine, waits)
    plain_steps = counted_plain_steps(engine)
    params = SamplingParams(max_new_tokens=max_new_tokens)  # answers end where the model ends them: arrivals vary
    before = probe_us()
    started, start = time.time(), time.perf_counter()
    with waits:
        requests = engine.generate_ids(prompts, params)
    wall = time.perf_counter() - start
    after = probe_us()
    del engine.step, engine.scheduler.schedule  # back to the class's methods
    if plain_steps is not None:
        del engine.decoding.launch
    decode = [r for r in records if not r[0]]
    prefill = [r for r in records if r[0]]
    tokens = sum(len(r.output_ids) for r in requests)
    taus = [r.stats.tau for r in requests if r.stats.tau is not None]
    verified = [q for r in requests for q in r.stats.verify_lengths]
    median_ms = lambda rows: 1e3 * statistics.median(r[2] for r in rows) if rows else 0.0  # noqa: E731
    return LoadRow(system, concurrency, len(requests), tokens, wall, tokens / wall, len(decode), median_ms(decode),
                   statistics.mean(r[1] for r in decode) if decode else 0.0, len(prefill), median_ms(prefill),
                   sum(r[2] for r in prefill) / wall, statistics.mean(taus) if taus else None,
                   statistics.mean(verified) if verified else None,
                   plain_steps=len(plain_steps) if plain_steps is not None else None,
                   steps=[step_trace(r) for r in records], started=started,
                   cached_share=sum(r.stats.cached_tokens or 0 for r in requests) / max(sum(map(len, prompts)), 1),
                   host_probe_us=[before, after])


def option_label(option) -> str:
    """What a speculative step verified (`SpeculativeDecoding.option`): "chain Q", "budget Q/PER" or "tree"."""
    if isinstance(option, Budget):
        return f"budget {option.q}/{option.per}"
    return "tree" if option == TREE else f"chain {option}"


def step_trace(record: tuple) -> list:
    prefilled, batch, seconds, verified, overheads, committed, switches, waited, kind, prompt_tokens, admitted = record
    in_ms = lambda pair: [round(1e3 * s, 3) for s in pair] if pair is not None else [None, None]  # noqa: E731
    return [int(prefilled), batch, round(1e3 * seconds, 3), verified, *in_ms(overheads), committed, *in_ms(switches),
            round(1e3 * waited, 3), kind, prompt_tokens, admitted]


def counted_plain_steps(engine) -> list | None:
    """From now on, one entry per plain decoding step a DFlash engine launches (None: no drafter)."""
    if engine.drafter is None:
        return None
    launches, launch = [], engine.decoding.launch

    def counted(*args, **kwargs):
        launches.append(1)
        return launch(*args, **kwargs)

    engine.decoding.launch = counted
    return launches


def median_run(runs: list[LoadRow]) -> LoadRow:
    """The run with the median tokens/s (the lower middle of an even count), with every run's tokens/s."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r.tokens_per_s)
    row = ordered[(len(ordered) - 1) // 2]
    row.runs_tokens_per_s = [r.tokens_per_s for r in runs]
    return row


STEP_RANGE = "specdec_step"


@dataclass
class StepProfile:
    system: str
    concurrency: int
    kind: str  # "with prefill", or decode only: "decode only" (plain decoding), "plain steps" or "speculative steps"
    steps: int
    wall_ms: float  # medians over the steps of this kind
    gpu_busy_ms: float
    # the kernels (and copies) that took most of these steps' GPU time: (name, us per step, launches per step)
    kernels: list[tuple[str, float, float]] = field(default_factory=list)


def profile_load(llm: LLM, system: str, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                 cuda: bool) -> list[StepProfile]:
    """One level under the profiler: per kind of step, median wall time and GPU busy time."""
    engine = llm.engine
    engine.scheduler.max_num_seqs = concurrency
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    records = timed_steps(engine, HostWaits())  # (waits not counted under the profiler)
    with torch.profiler.profile(activities=activities) as prof:
        engine.generate_ids(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    del engine.step, engine.scheduler.schedule
    windows = range_activity(prof, STEP_RANGE)
    if len(windows) != len(records):
        raise RuntimeError(f"the profiler recorded {len(windows)} step ranges for {len(records)} steps")
    return [StepProfile(system, concurrency, kind, len(picked), 1e3 * statistics.median(records[i][2] for i in picked),
                        1e-6 * statistics.median(windows[i].busy_ns for i in picked),
                        top_kernels([windows[i].activity for i in picked]))
            for kind, picked in steps_by_kind(records).items()]


# a drafter's decode-only steps split by kind: under `auto` a plain step's GPU work (its forward and the drafter's
# context rows) is set against plain decoding's, and a speculative step's against both
PROFILE_KINDS = ("decode only", "plain steps", "speculative steps", "with prefill")

HOST_FUNCTIONS = 40  # rows of each list of a host profile (its tail spreads thin: steps with prefill)
WAIT_SITES = 12  # rows of a host profile's lists of where the host waited


@dataclass
class HostProfile:
    system: str
    concurrency: int
    kind: str  # as StepProfile's
    steps: int
    wall_ms: float  # their median, under cProfile
    functions: dict  # `scripts.bench.host_profile.per_step`'s two lists of [function, us per step, calls per step]
    waited_ms: float = 0.0  # the median step's waits for the GPU (CUDA event waits)
    # where those waits were (`HostWaits(sites=True)`): [site, ms per step, waits per step], the most time first
    wait_sites: list = field(default_factory=list)
    # torch calls that made the host wait by themselves (CUDA's sync debug mode): [site, calls per step], most first
    synced: list = field(default_factory=list)


def host_profile_load(llm: LLM, system: str, prompts: list[list[int]], concurrency: int,
                      max_new_tokens: int) -> list[HostProfile]:
    """One level under cProfile, each step profiled apart and summed with the steps of its kind: per kind, the median
    wall time, the host functions that took most of it, and where the host waited for the GPU."""
    engine = llm.engine
    engine.scheduler.max_num_seqs = concurrency
    waits = HostWaits(sites=True)
    records = timed_steps(engine, waits)
    timed, by_kind, sites = engine.step, {}, {}

    def profiled_step(*args, **kwargs):
        profile, count = cProfile.Profile(), len(records)
        out = profile.runcall(timed, *args, **kwargs)
        kind = profile_kind(records[count])
        by_kind[kind] = by_kind[kind].add(profile) if kind in by_kind else pstats.Stats(profile)
        for total, taken in zip(sites.setdefault(kind, (Counter(), Counter(), Counter())), waits.take_sites()):
            total.update(taken)
        return out

    engine.step = profiled_step
    with waits:
        engine.generate_ids(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    del engine.step, engine.scheduler.schedule
    profiles = []
    for kind, picked in steps_by_kind(records).items():
        n, (waited_at, waits_at, synced_at) = len(picked), sites[kind]
        profiles.append(HostProfile(
            system, concurrency, kind, n, 1e3 * statistics.median(records[i][2] for i in picked),
            per_step(by_kind[kind].stats, n, HOST_FUNCTIONS, exclude=__file__),  # (the benchmark's wrappers left out)
            1e3 * statistics.median(records[i][7] for i in picked),
            [[site, 1e3 * seconds / n, waits_at[site] / n] for site, seconds in waited_at.most_common(WAIT_SITES)],
            [[site, calls / n] for site, calls in synced_at.most_common(WAIT_SITES)]))
    return profiles


def steps_by_kind(records: list[tuple]) -> dict[str, list[int]]:
    """The indices of the `timed_steps` records of each kind (`profile_kind`) that ran, in PROFILE_KINDS' order."""
    kinds = [profile_kind(r) for r in records]
    return {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in PROFILE_KINDS if kind in kinds}


def profile_kind(record: tuple) -> str:
    """The kind a step is profiled as, from its `timed_steps` record (prefilled, batch, seconds, verified, ...)."""
    prefilled, verified = record[0], record[3]
    if prefilled:
        return "with prefill"
    return {None: "decode only", 1: "plain steps"}.get(verified, "speculative steps")


def profile_table(profiles: list[StepProfile]) -> str:
    lines = ["| system | concurrency | steps | count | wall ms (median) | GPU busy ms (median) | busy / wall |",
             "|---|---|---|---|---|---|---|"]
    for p in profiles:
        share = p.gpu_busy_ms / p.wall_ms if p.wall_ms else 0.0
        lines.append(f"| {p.system} | {p.concurrency} | {p.kind} | {p.steps} | {p.wall_ms:.2f} | {p.gpu_busy_ms:.2f} | "
                     f"{100 * share:.0f}% |")
    for p in profiles:
        lines += ["", f"{p.system}, concurrency {p.concurrency}, {p.kind}: the GPU's largest items per step", "",
                  "| kernel | us per step | launches per step |", "|---|---|---|"]
        lines += [f"| `{name}` | {us:.1f} | {launches:.1f} |" for name, us, launches in p.kernels]
    return "\n".join(lines)


def host_profile_table(profiles: list[HostProfile]) -> str:
    lines = []
    for p in profiles:
        lines += ["", f"{p.system}, concurrency {p.concurrency}, {p.kind}: {p.steps} steps, median {p.wall_ms:.2f} ms "
                      "under cProfile"]
        lines += tables(p.functions)
        lines += ["", f"where the host waited for the GPU: median {p.waited_ms:.2f} ms a step (CUDA event waits)", "",
                  "| site | ms per step | waits per step |", "|---|---|---|"]
        lines += [f"| `{site}` | {ms:.3f} | {count:.2f} |" for site, ms, count in p.wait_sites]
        if p.synced:
            lines += ["", "torch calls that waited for the GPU by themselves (CUDA's sync debug mode)", "",
                      "| site | calls per step |", "|---|---|"]
            lines += [f"| `{site}` | {calls:.2f} |" for site, calls in p.synced]
    return "\n".join(lines)


def table(rows: list[LoadRow]) -> str:
    lines = ["| system | concurrency | tokens/s | decode steps x median ms (mean batch) | steps with prefill x "
             "median ms | share of wall in prefill steps | prompt tokens cached | tau | verified per step | "
             "plain steps | host probe us, before / after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tau = f"{r.tau:.2f}" if r.tau is not None else "-"
        verified = f"{r.verified:.1f}" if r.verified is not None else "-"
        spread = (f" ({min(r.runs_tokens_per_s):,.0f}-{max(r.runs_tokens_per_s):,.0f} over {len(r.runs_tokens_per_s)})"
                  if r.runs_tokens_per_s else "")
        lines.append(f"| {r.system} | {r.concurrency} | {r.tokens_per_s:,.0f}{spread} | {r.decode_steps} x "
                     f"{r.decode_step_ms:.2f} ({r.decode_batch:.1f}) | {r.prefill_steps} x {r.prefill_step_ms:.2f} | "
                     f"{100 * r.prefill_share:.0f}% | {100 * (r.cached_share or 0):.0f}% | {tau} | {verified} | "
                     f"{r.plain_steps if r.plain_steps is not None else '-'} | {probes(r)} |")
    return "\n".join(lines)


def probes(row: LoadRow) -> str:
    return " / ".join(f"{us:,.0f}" for us in row.host_probe_us) if row.host_probe_us else "-"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model, drafter = args.model, args.drafter
        if args.quick and model is None:
            model = str(random_target(Path(tmp) / "target", TINY_SHAPE, torch.device("cpu"), std=0.2))
            drafter = drafter or str(tiny_drafter(Path(tmp) / "drafter", Path(model)))
        # (name, drafter, verify policy, overlap_steps)
        overlaps = {"off": (False,), "both": (False, True), "on": (True,)}[args.overlap_steps]
        systems = [("AR" if not overlap else OVERLAPPED, None, "chain", overlap) for overlap in overlaps]
        for verify in args.verify if drafter else ():
            systems += [(DFLASH[verify] + (AHEAD if overlap else ""), drafter, verify, overlap) for overlap in overlaps]
        runner = run_interleaved if args.interleave else run_in_turn
        rows, profiles, host_profiles, engines = runner(args, model, systems, device)
    print(table(rows))
    if args.interleave:
        print("\nTokens/s over the first system's, round by round (--interleave), and at the level's own load:\n")
        print(paired_table(rows))
    print("\nDecode-only steps by batch and kind (scripts/bench/step_trace.py):\n")
    print(trace_table([(r.system, r.concurrency, trace_bins(r.steps)) for r in rows]))
    print("\nSteps with prompt chunks beside decoding requests, by the requests they admitted:\n")
    print(prompt_step_table([(r.system, r.concurrency, r.steps) for r in rows]))
    if profiles:
        print(profile_table(profiles))
    if host_profiles:
        print("\nHost time per kind of step, under cProfile (--host-profile):")
        print(host_profile_table(host_profiles))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "environment": environment(device),
                                              "engines": engines, "rows": [asdict(r) for r in rows],
                                              "profiles": [asdict(p) for p in profiles],
                                              "host_profiles": [asdict(p) for p in host_profiles]}, indent=1))
    return 0


def load_system(args, model: str, system: tuple, device: torch.device, **options) -> tuple[LLM, list[list[int]]]:
    """A system's engine, warmed up (graphs, kernels, allocator), and its prompts."""
    name, draft, verify, overlap = system
    llm = LLM(model, draft, device=str(device), max_num_seqs=most_in_flight(args), kv_cache_dtype=args.kv_cache_dtype,
              overlap_steps=overlap, enable_prefix_caching=not args.no_prefix_caching,
              **SETTINGS.get(verify, {"verify": verify}),
              **({setting: value for setting, value in (("draft_window", args.draft_window),
                                                        ("draft_vocab", args.draft_vocab))
                  if draft and value is not None}),
              **options)
    prompts = (random_prompts(llm.engine.model.config.vocab_size, args.requests) if args.quick
               else chat_prompts(llm, args.requests, args.dataset, args.system_repeat))
    run_load(llm, name, prompts[:min(4, len(prompts))], 1, 4)
    return llm, prompts


def most_in_flight(args) -> int:
    """The engines' max_num_seqs: the highest concurrency run, the profiled levels' included (a level sets the
    scheduler's limit, and the engine's buffers must hold that many requests)."""
    return max([*args.concurrency, *(c for c in (args.profile, args.host_profile) if c is not None)])


def level_prompts(args, prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    return prompts if args.rounds is None else prompts[:min(len(prompts), args.rounds * concurrency)]


def engine_record(args, name: str, llm: LLM) -> dict:
    return {"system": name, "kv_cache_dtype": args.kv_cache_dtype, "num_kv_pages": llm.engine.num_pages,
            "kv_full_precision_layers": list(llm.engine.full_precision_layers)}


def profile_system(args, llm: LLM, name: str, prompts: list[list[int]],
                   device: torch.device) -> tuple[list[StepProfile], list[HostProfile]]:
    """The levels under the torch profiler (--profile) and under cProfile (--host-profile) asked for."""
    def level(concurrency: int) -> list[list[int]]:
        if not args.keep_prefix_cache:
            llm.reset_prefix_cache()
        return prompts[:min(len(prompts), 2 * concurrency)]  # the profiler's own cost grows with the run

    profiles = ([] if args.profile is None else
                profile_load(llm, name, level(args.profile), args.profile, args.max_new_tokens, device.type == "cuda"))
    host_profiles = ([] if args.host_profile is None else
                     host_profile_load(llm, name, level(args.host_profile), args.host_profile, args.max_new_tokens))
    return profiles, host_profiles


def run_in_turn(args, model: str, systems: list[tuple], device: torch.device):
    """Each system's engine alone on the GPU, its levels one after the other."""
    rows, profiles, host_profiles, engines = [], [], [], []
    for system in systems:
        name = system[0]
        llm, prompts = load_system(args, model, system, device)
        for concurrency in args.concurrency:
            chosen = level_prompts(args, prompts, concurrency)
            rows.append(median_run([run_load(llm, name, chosen, concurrency, args.max_new_tokens,
                                             cold=not args.keep_prefix_cache) for _ in range(args.repeats)]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        engines.append(engine_record(args, name, llm))
        system_profiles, system_host_profiles = profile_system(args, llm, name, prompts, device)
        profiles += system_profiles
        host_profiles += system_host_profiles
        del llm
        release_memory(device)
    return rows, profiles, host_profiles, engines


def run_interleaved(args, model: str, systems: list[tuple], device: torch.device):
    """Every system's engine at once, each taking an equal share of the GPU memory (engine k may fill up to
    (k + 1) / n of the default 0.9, what the engines before it took counted); each level's rounds run the systems
    in turn, so that a slow period of the machine falls on both sides of a pair."""
    loaded = []
    for k, system in enumerate(systems):
        share = dict(gpu_memory_utilization=0.9 * (k + 1) / len(systems)) if device.type == "cuda" else {}
        loaded.append(load_system(args, model, system, device, **share))
    rows = []
    for concurrency in args.concurrency:
        runs = [[] for _ in systems]
        for _ in range(args.repeats):
            for (name, *_), (llm, prompts), system_runs in zip(systems, loaded, runs):
                system_runs.append(run_load(llm, name, level_prompts(args, prompts, concurrency), concurrency,
                                            args.max_new_tokens, cold=not args.keep_prefix_cache))
        for system_runs in runs:
            paired = [run.tokens_per_s / first.tokens_per_s for run, first in zip(system_runs, runs[0])]
            rows.append(median_run(system_runs))
            rows[-1].paired = paired
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    engines = [engine_record(args, name, llm) for (name, *_), (llm, _) in zip(systems, loaded)]
    profiles, host_profiles = [], []
    for (name, *_), (llm, prompts) in zip(systems, loaded):
        system_profiles, system_host_profiles = profile_system(args, llm, name, prompts, device)
        profiles += system_profiles
        host_profiles += system_host_profiles
    del loaded
    release_memory(device)
    return rows, profiles, host_profiles, engines


def paired_table(rows: list[LoadRow]) -> str:
    """Each round's tokens/s over the first system's, and (`load_rate`, the median round) what the decode-only steps
    of at least half the concurrency delivered a request a ms over the first system's: a level's tokens/s also counts
    the tail its last requests decode in fewer company, where speculation gains most."""
    lines = ["| system | concurrency | median | each round | at half the concurrency or more: tokens a request a ms "
             "(share of decode-step time) | over the first system's |", "|---|---|---|---|---|---|"]
    firsts = {}
    for r in rows:
        if r.paired is None:
            continue
        rate = load_rate(r.steps or [], r.concurrency)
        first = firsts.setdefault(r.concurrency, rate)
        at_load = "-" if rate is None else f"{rate[0]:.3f} ({100 * rate[1]:.0f}%)"
        over = "-" if rate is None or first is None else f"{rate[0] / first[0]:.3f}x"
        lines.append(f"| {r.system} | {r.concurrency} | {statistics.median(r.paired):.3f}x | "
                     f"{' '.join(f'{x:.3f}' for x in r.paired)} | {at_load} | {over} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

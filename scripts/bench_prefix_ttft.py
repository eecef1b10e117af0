"""Time to first token with and without the prefix cache, in the library (no server in between).

    python scripts/bench_prefix_ttft.py --model NAME --system-repeat 1 12 --out ttft.json   # GPU
    python scripts/bench_prefix_ttft.py --quick --out /tmp/ttft.json                         # CPU smoke run

Conversations of the multiturn set (scripts/bench/chat_prompts.py) as token ids: turn 1 is the shared
system prompt (repeated --system-repeat times, for long contexts) and the conversation's first question;
turn 2 resends turn 1 with an answer of --assistant-words words and a follow-up. Each turn is one
`LLM.generate` call of one new token, timed from the call to its return (the prefill and the first
token; the host's work included), with the cache on and then off (a fresh `LLM` each). Medians over
the conversations after the first (which warms up); with the cache on, later conversations find the
system prompt cached, as requests sharing a system prompt do.

--profile K adds, with the cache on, K more conversations under the torch profiler (each turn one range:
its wall time against the GPU's busy time, the host time before its first kernel, its largest kernels) and
K more under cProfile (the host functions that take a cached turn's time). Not counted in the table.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/bench_prefix_ttft.py`: the repo's packages
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from scripts.bench.chat_prompts import load_prompts  # noqa: E402
from scripts.bench.gpu_profile import range_activity, top_kernels  # noqa: E402
from scripts.bench.random_models import TINY_SHAPE, random_target  # noqa: E402
from scripts.bench.runner import environment, release_memory  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="demo name or HF model directory")
    p.add_argument("--drafter", default="auto", help="as LLM's drafter: auto, none, a name or a directory")
    p.add_argument("--system-repeat", type=int, nargs="+", default=[1, 12], help="system prompt copies, per run")
    p.add_argument("--assistant-words", type=int, default=100, help="words of the answer turn 2 resends")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny random model, small sizes")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="K more conversations, cache on, under the torch profiler and under cProfile")
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    if min(args.system_repeat) < 1 or args.conversations < 2 or args.assistant_words < 0:
        p.error("--system-repeat >= 1, --conversations >= 2 and --assistant-words >= 0")
    return args


def word_ids(text: str) -> list[int]:
    """--quick's tokenizer: a word's id from its characters (the tiny model's word-level tokenizer knows no words)."""
    return [sum(map(ord, word)) % 500 for word in text.split()]


def turns(encode, repeat: int, assistant_words: int, count: int, skip: int = 0) -> list[tuple[list[int], list[int]]]:
    """(turn 1, turn 2) token ids of `count` conversations after the first `skip`, through `encode` (text -> ids)."""
    out = []
    for conversation in load_prompts("multiturn", 0, repeat)[skip:skip + count]:
        first = encode(conversation.system) + encode(conversation.text)
        out.append((first, first + encode("x " * assistant_words) + encode(conversation.follow_ups[0])))
    return out


def timed_generate(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """Seconds of one generate call of one token, and the prompt tokens the cache held."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    [result] = llm.generate([ids], SamplingParams(max_new_tokens=1))
    sync()
    return time.perf_counter() - start, result.stats.cached_tokens or 0


def encoder(llm: LLM, args):
    return word_ids if args.quick else (lambda text: llm.tokenizer.encode(text, add_special_tokens=False))


def measure(llm: LLM, repeat: int, args) -> dict:
    """Median seconds of turns 1 and 2 (and the cached prompt tokens) over the conversations after the first."""
    conversations = turns(encoder(llm, args), repeat, args.assistant_words, args.conversations)
    rows = [[timed_generate(llm, ids) for ids in pair] for pair in conversations]
    later = rows[1:]  # the first conversation warms up
    return {"prompt_tokens": [statistics.median(len(pair[t]) for pair in conversations) for t in range(2)],
            **{f"turn{t + 1}": {"ms": 1e3 * statistics.median(r[t][0] for r in later),
                                "cached_tokens": statistics.median(r[t][1] for r in later)} for t in range(2)}}


TURN_RANGE = "specdec_turn"


def profile_turns(llm: LLM, repeat: int, args) -> dict:
    """Conversations after the measured ones, cache on: per turn under the torch profiler, the medians of wall
    time, GPU busy time and host time before the first kernel, and the largest kernels; then the host
    functions of as many more turns under cProfile (text)."""
    count = args.profile
    conversations = turns(encoder(llm, args), repeat, args.assistant_words, 2 * count, skip=args.conversations)
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with torch.profiler.profile(activities=activities) as prof:
        for pair in conversations[:count]:
            for ids in pair:
                with torch.profiler.record_function(TURN_RANGE):
                    walls.append(timed_generate(llm, ids)[0])
    windows = range_activity(prof, TURN_RANGE)
    if len(windows) != len(walls):  # turns 1 and 2 alternate: a range lost would pair them wrongly
        raise RuntimeError(f"the profiler recorded {len(windows)} turn ranges for {len(walls)} turns")
    result = {}
    for turn in (0, 1):
        picked = windows[turn::2]
        first = [w.first_launch_ns for w in picked if w.first_launch_ns is not None]
        result[f"turn{turn + 1}"] = {
            "wall_ms": 1e3 * statistics.median(walls[turn::2]),
            "gpu_busy_ms": 1e-6 * statistics.median(w.busy_ns for w in picked),
            "before_first_kernel_ms": 1e-6 * statistics.median(first) if first else None,
            "kernels": top_kernels([w.activity for w in picked], top=15)}
    profiler = cProfile.Profile()
    for first, later in conversations[count:]:
        timed_generate(llm, first)
        profiler.enable()
        timed_generate(llm, later)
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
    result["turn2_host_functions"] = text.getvalue()
    result["turns"] = len(conversations) - count
    return result


def print_profile(repeat: int, profile: dict) -> None:
    for turn in ("turn1", "turn2"):
        p = profile[turn]
        first = p["before_first_kernel_ms"]
        print(f"\nsystem x{repeat}, {turn} under the profiler: wall {p['wall_ms']:.2f} ms, GPU busy {p['gpu_busy_ms']:.2f} ms, "
              f"host before the first kernel {first if first is None else round(first, 2)} ms")
        print("| kernel | us | launches |\n|---|---|---|")
        for name, us, launches in p["kernels"]:
            print(f"| `{name}` | {us:.1f} | {launches:.0f} |")
    print(f"\nsystem x{repeat}, turn 2 host functions (cProfile, {profile['turns']} turns):\n" + profile["turn2_host_functions"])


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, drafter, options = args.model, None if args.drafter == "none" else args.drafter, {}
        if args.quick:
            model = str(random_target(Path(tmp) / "target", TINY_SHAPE, torch.device("cpu")))
            drafter, options = None, {"device": "cpu", "num_kv_pages": 512}
            args.system_repeat, args.assistant_words, args.conversations = [1], 20, 3
        runs = {repeat: {"system_repeat": repeat} for repeat in args.system_repeat}
        for caching in (True, False):  # one LLM each
            llm = LLM(model, drafter=drafter, enable_prefix_caching=caching, **options)
            for repeat, entry in runs.items():
                entry["cache" if caching else "no_cache"] = measure(llm, repeat, args)
                if caching and args.profile:
                    entry["profile"] = profile_turns(llm, repeat, args)
            device = llm.engine.device
            del llm
            release_memory(device)
    print("| prompt tokens | turn | cached tokens | ms, cache | ms, no cache | cache / no cache |")
    print("|---|---|---|---|---|---|")
    for entry in runs.values():
        print_row(entry)
    for repeat, entry in runs.items():
        if "profile" in entry:
            print_profile(repeat, entry["profile"])
    result = {"command_line": " ".join(["scripts/bench_prefix_ttft.py", *(argv if argv is not None else sys.argv[1:])]),
              "environment": environment(device), "runs": list(runs.values())}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


def print_row(entry: dict) -> None:
    for turn in (0, 1):
        on, off = entry["cache"][f"turn{turn + 1}"], entry["no_cache"][f"turn{turn + 1}"]
        print(f"| {entry['cache']['prompt_tokens'][turn]:.0f} | turn {turn + 1} | {on['cached_tokens']:.0f} | {on['ms']:.2f} "
              f"| {off['ms']:.2f} | {on['ms'] / off['ms']:.0%} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())

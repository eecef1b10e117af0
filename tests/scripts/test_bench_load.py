"""scripts/bench_load.py: every concurrency delivers every request's tokens, and its step accounting adds up."""

import json

from scripts.bench.chat_prompts import load_prompts
from scripts.bench_load import LoadRow, chat_prompts, main, paired_table

IN_ORDER = ["--verify", "chain", "--overlap-steps", "off"]  # rows "AR" and "DFlash": chains, steps in order


def test_quick_run_reports_every_system_and_concurrency(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["--quick", *IN_ORDER, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [("AR", 1), ("AR", 4), ("DFlash", 1), ("DFlash", 4)]
    for row in rows:
        assert 0 < row["tokens"] <= row["requests"] * 8
        assert row["prefill_steps"] >= 1 and row["decode_steps"] >= 1
        assert 0 < row["prefill_share"] < 1 and row["decode_batch"] <= row["concurrency"]
        # each run starts from an empty prefix cache, and the random prompts share nothing
        assert row["cached_share"] == 0
        assert (row["tau"] is None) == (row["system"] == "AR")
        # on CPU nothing is measured, so the policy verifies the whole chain (the tiny drafter's block)
        assert row["verified"] == (None if row["system"] == "AR" else 4.0)
        assert row["plain_steps"] == (None if row["system"] == "AR" else 0)  # nothing measured: no plain steps
        steps = row["steps"]  # the step trace: one entry per step, in order
        assert len(steps) == row["decode_steps"] + row["prefill_steps"]
        assert sum(s[0] for s in steps) == row["prefill_steps"] and max(s[1] for s in steps) <= row["concurrency"]
        decoding = [s for s in steps if s[1]]
        if row["system"] == "AR":
            assert all(s[3:6] == [None, None, None] and s[7:9] == [None, None] and s[10] is None for s in steps)
        else:  # the whole chain every step; nothing measured, so no overhead or switch cost learned
            assert all(s[3] == 4 and s[4:6] == [0.0, 0.0] and s[7:9] == [0.0, 0.0] for s in decoding)
            assert all(s[10] == ("chain 4" if s[1] else None) for s in steps)  # each step's kind
        assert sum(s[6] for s in steps) == row["tokens"]  # each token committed in exactly one step
        assert all(s[9] == 0.0 for s in steps)  # the host never waits for a GPU on the CPU
        # every request admitted once, by a step that ran prompt tokens; steps without a prompt ran none
        assert sum(s[12] for s in steps) == row["requests"] and all((s[11] > 0) == bool(s[0]) for s in steps)
        assert len(row["host_probe_us"]) == 2 and all(us > 0 for us in row["host_probe_us"])  # before and after
    printed = capsys.readouterr().out
    assert all(r["started"] > 1.7e9 for r in rows)  # unix time
    assert "| DFlash | 4 |" in printed and "| DFlash | 4 | 1-31 | speculative |" in printed  # and the steps by batch


def test_without_the_prefix_cache_every_run_prefills_its_prompts_whole(tmp_path):
    out = tmp_path / "load.json"
    assert main(["--quick", "--no-prefix-caching", "--concurrency", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(row["cached_share"] == 0 for row in rows)


def test_kept_across_runs_the_prefix_cache_holds_what_earlier_runs_of_the_same_prompts_left(tmp_path):
    out = tmp_path / "load.json"
    assert main(["--quick", "--keep-prefix-cache", "--concurrency", "4", "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(0 < row["cached_share"] <= 1 for row in rows)


def test_each_verify_policy_has_a_dflash_row(tmp_path):
    out = tmp_path / "load.json"
    assert main(["--quick", "--verify", "chain", "auto", "budget", "--overlap-steps", "off", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(dict.fromkeys(r["system"] for r in rows)) == ["AR", "DFlash", "DFlash auto", "DFlash auto+budgets"]


def test_overlap_steps_adds_the_overlapped_and_drafted_ahead_rows_with_the_same_tokens(tmp_path):
    out = tmp_path / "load.json"
    assert main(["--quick", "--verify", "chain", "--overlap-steps", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(dict.fromkeys(r["system"] for r in rows)) == ["AR", "AR overlapped", "DFlash", "DFlash, drafted ahead"]
    tokens = {(r["system"], r["concurrency"]): (r["tokens"], r["tau"]) for r in rows}
    for concurrency in (1, 4):  # greedy, the same requests: the same tokens, and drafts ahead accept the same
        assert tokens[("AR", concurrency)][0] == tokens[("AR overlapped", concurrency)][0]
        assert tokens[("DFlash", concurrency)] == tokens[("DFlash, drafted ahead", concurrency)]
    assert main(["--quick", "--verify", "chain", "--overlap-steps", "on", "--out", str(out)]) == 0  # no in-order rows
    rows = json.loads(out.read_text())["rows"]
    assert list(dict.fromkeys(r["system"] for r in rows)) == ["AR overlapped", "DFlash, drafted ahead"]


def test_the_defaults_are_the_engines(tmp_path):
    """Without flags the rows run the engine's defaults: overlapped plain decoding, and `auto` drafting ahead."""
    out = tmp_path / "load.json"
    assert main(["--quick", "--concurrency", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert list(dict.fromkeys(r["system"] for r in rows)) == ["AR overlapped", "DFlash auto, drafted ahead"]


def test_a_serving_dataset_gives_bench_serves_prompts_in_its_order():
    class Chat:  # the chat template reduced to the user's text
        encode_chat = staticmethod(lambda messages: messages[0]["content"])

    assert chat_prompts(Chat(), 5, "mixed") == [p.text for p in load_prompts("mixed", seed=0)[:5]]
    math500 = chat_prompts(Chat(), 4)  # the default alternates math500 and coding requests
    assert math500[0::2] == [p.text for p in load_prompts("math500", seed=0)[:2]]


def test_a_step_is_profiled_by_its_kind():
    from scripts.bench_load import profile_kind

    # (prefilled, batch, seconds, tokens verified per request, ...)
    assert profile_kind((True, 4, 0.01, 4)) == "with prefill"
    assert profile_kind((False, 4, 0.01, None)) == "decode only"  # plain decoding's engine
    assert profile_kind((False, 4, 0.01, 1)) == "plain steps"
    assert profile_kind((False, 4, 0.01, 8)) == "speculative steps"


def test_profile_level_splits_steps_by_kind(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["--quick", *IN_ORDER, "--profile", "4", "--out", str(out)]) == 0
    profiles = json.loads(out.read_text())["profiles"]
    # a drafter's decode-only steps by kind (on CPU nothing is measured, so every one speculates)
    assert [(p["system"], p["kind"]) for p in profiles] == [("AR", "decode only"), ("AR", "with prefill"),
                                                            ("DFlash", "speculative steps"), ("DFlash", "with prefill")]
    assert all(p["steps"] >= 1 and p["wall_ms"] > 0 and p["gpu_busy_ms"] == 0 for p in profiles)  # CPU: no GPU
    assert "| busy / wall |" in capsys.readouterr().out


def test_a_profiled_level_above_the_measured_concurrencies_runs_in_engines_sized_for_it(tmp_path):
    out = tmp_path / "load.json"  # --quick measures 1 and 4 in flight; its 6 requests all run at once in the profile
    assert main(["--quick", *IN_ORDER, "--profile", "6", "--host-profile", "6", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {p["concurrency"] for p in results["profiles"] + results["host_profiles"]} == {6}


def test_repeats_report_the_median_run_and_every_runs_tokens_per_s(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["--quick", *IN_ORDER, "--repeats", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4  # one row per system and level, not per run
    for row in rows:
        runs = row["runs_tokens_per_s"]
        assert len(runs) == 3 and row["tokens_per_s"] == sorted(runs)[1]
    assert " over 3) |" in capsys.readouterr().out


def test_interleave_runs_the_systems_in_turn_and_pairs_each_round_with_the_first_system(tmp_path, capsys):
    import scripts.bench_load as bench_load

    order = []
    run_load = bench_load.run_load

    def recorded(llm, system, prompts, concurrency, max_new_tokens, cold=False):
        order.append((system, concurrency, cold))
        return run_load(llm, system, prompts, concurrency, max_new_tokens, cold)

    out = tmp_path / "load.json"
    bench_load.run_load = recorded
    try:
        assert main(["--quick", *IN_ORDER, "--interleave", "--repeats", "2", "--out", str(out)]) == 0
    finally:
        bench_load.run_load = run_load
    # the warm-ups (4 prompts at concurrency 1) come first, one per engine; then each level's rounds alternate, each
    # from an empty prefix cache
    assert order[:2] == [("AR", 1, False), ("DFlash", 1, False)]
    assert order[2:] == [("AR", 1, True), ("DFlash", 1, True)] * 2 + [("AR", 4, True), ("DFlash", 4, True)] * 2
    rows = json.loads(out.read_text())["rows"]
    assert [(r["system"], r["concurrency"]) for r in rows] == [("AR", 1), ("DFlash", 1), ("AR", 4), ("DFlash", 4)]
    for row in rows:
        assert len(row["paired"]) == 2 and len(row["runs_tokens_per_s"]) == 2
        if row["system"] == "AR":
            assert row["paired"] == [1.0, 1.0]
    for ar, dflash in zip(rows[0::2], rows[1::2]):  # each round's ratio is of the runs of that round
        assert dflash["paired"] == [d / a for d, a in zip(dflash["runs_tokens_per_s"], ar["runs_tokens_per_s"])]
    assert "Tokens/s over the first system's, round by round" in capsys.readouterr().out


def test_the_paired_table_sets_each_system_against_the_first_at_the_levels_own_load():
    def row(system, steps, paired):  # steps: (batch, wall ms, tokens committed; 1 token a request: a plain step)
        trace = [[0, b, ms, 1 if tokens is None else 4, 0.0, 0.0, tokens or 0, 0.0, 0.0, 0.5]
                 for b, ms, tokens in steps]
        return LoadRow(system, 64, 128, 0, 1.0, 1.0, len(steps), 0.0, 0.0, 0, 0.0, 0.0, None, paired=paired,
                       steps=trace)

    plain = row("AR", [(64, 2.0, None), (10, 2.0, None)], [1.0])
    dflash = row("DFlash", [(64, 4.0, 192), (10, 3.0, 40)], [1.9])  # 3 tokens a request in 4 ms at 64
    table = paired_table([plain, dflash])
    assert "| AR | 64 | 1.000x | 1.000 | 0.500 (50%) | 1.000x |" in table
    assert "| DFlash | 64 | 1.900x | 1.900 | 0.750 (57%) | 1.500x |" in table


def test_host_profile_level_lists_the_host_functions_of_each_kind_of_step(tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["--quick", *IN_ORDER, "--host-profile", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["profiles"] == []  # the torch profiler's level was not asked for
    profiles = results["host_profiles"]
    assert [(p["system"], p["kind"]) for p in profiles] == [("AR", "decode only"), ("AR", "with prefill"),
                                                            ("DFlash", "speculative steps"), ("DFlash", "with prefill")]
    for p in profiles:
        assert p["steps"] >= 1 and p["wall_ms"] > 0
        own, inclusive = p["functions"]["host_functions"], p["functions"]["host_functions_inclusive"]
        assert own and all(us >= 0 and calls > 0 for _, us, calls in own)
        # the engine's step heads the project's list; the benchmark's own wrappers are left out
        assert inclusive[0][0].startswith("engine.py:") and not any("bench_load.py" in f for f, _, _ in inclusive)
        # where the host waited: none on the CPU (no CUDA events), the lists there and empty
        assert p["waited_ms"] == 0 and p["wait_sites"] == [] and p["synced"] == []
    speculative = [f for f, _, _ in profiles[2]["functions"]["host_functions_inclusive"]]
    assert any(f.startswith("speculator.py:") for f in speculative)
    out = capsys.readouterr().out
    assert "DFlash, concurrency 4, with prefill:" in out and "where the host waited for the GPU: median 0.00 ms" in out

"""scripts/bench/step_trace.py: a step trace summed by batch range and kind of step."""

import pytest

from scripts.bench.step_trace import load_rate, prompt_step_table, step_kind, trace_bins, trace_table


def test_decode_only_steps_are_summed_by_batch_range_and_kind():
    # [prefilled, batch, wall ms, verified per request, overheads (2), committed, switch costs (2), host's wait]
    steps = [[1, 0, 20.0, None, None, None, 256, None, None, 0.0],  # the prompts' step: not a decode-only step
             [0, 256, 3.0, 1, 0.0, 0.0, 0, 0.0, 0.0, 0.6],  # plain (commits nothing yet: overlapped)
             [0, 250, 4.0, 1, 0.0, 0.0, 256, 0.0, 0.0, 0.0],  # host-bound
             [0, 240, 8.0, 2, 0.0, 0.0, 600, 0.0, 0.0, 1.0],  # a chain of 2
             [0, 150, 6.0, 4, 0.0, 0.0, 330, 0.0, 0.0, 0.5],
             [1, 140, 9.0, 4, 0.0, 0.0, 300, 0.0, 0.0, 0.0],  # with a prompt chunk: left out
             [0, 10, 3.0, 8, 0.0, 0.0, 40, 0.0, 0.0, 0.1]]
    bins = {(b.batches, b.kind): b for b in trace_bins(steps)}
    assert set(bins) == {(">= 200", "plain"), (">= 200", "speculative"), ("100-199", "speculative"),
                         ("1-31", "speculative")}
    plain = bins[">= 200", "plain"]
    assert (plain.steps, plain.wall_ms, plain.median_ms, plain.mean_batch) == (2, 7.0, 3.5, 253)
    assert plain.tokens_per_request == 1.0 and plain.tokens_per_request_ms == pytest.approx(1 / 3.5)
    assert plain.waited_ms == pytest.approx(0.3)
    chain = bins[">= 200", "speculative"]
    assert chain.tokens_per_request == pytest.approx(2.5) and chain.tokens_per_request_ms == pytest.approx(2.5 / 8)
    assert bins["1-31", "speculative"].tokens_per_request == 4.0
    table = trace_table([("DFlash", 256, trace_bins(steps))])
    assert "| DFlash | 256 | 100-199 | speculative | 1 | 6.0 | 6.00 | 0.50 | 150 | 2.20 | 0.367 |" in table


def test_a_run_without_a_drafter_has_only_plain_steps():
    steps = [[0, 64, 2.0, None, None, None, 64, None, None, 0.5], [0, 20, 1.0, None, None, None, 20, None, None, 0.2]]
    assert [(b.batches, b.kind, b.steps) for b in trace_bins(steps)] == [("32-99", "plain", 1), ("1-31", "plain", 1)]


def test_traces_recorded_before_the_hosts_waits_were_leave_that_column_empty():
    bins = trace_bins([[0, 64, 2.0, None, None, None, 64, None, None]])
    assert bins[0].waited_ms is None and "| 2.00 | - | 64 |" in trace_table([("AR", 64, bins)])


def test_budget_steps_are_a_kind_of_their_own_where_the_trace_names_kinds():
    chain = [0, 64, 4.0, 5, 0.0, 0.0, 200, 0.0, 0.0, 1.0, "chain 5"]
    budget = [0, 64, 4.2, 5, 0.0, 0.0, 240, 0.0, 0.0, 1.0, "budget 8/5"]
    plain = [0, 64, 2.0, 1, 0.0, 0.0, 64, 0.0, 0.0, 1.0, None]
    assert [step_kind(s) for s in (chain, budget, plain, chain[:10])] == ["speculative", "budget", "plain", "speculative"]
    bins = {b.kind: b for b in trace_bins([chain, budget, plain])}
    assert bins["budget"].steps == 1 and bins["budget"].tokens_per_request == pytest.approx(240 / 64)
    assert bins["speculative"].tokens_per_request_ms == pytest.approx(200 / 64 / 4.0)


def test_the_rate_at_the_levels_load_counts_only_steps_of_half_the_concurrency_or_more():
    # [prefilled, batch, wall ms, verified per request, overheads (2), committed, switch costs (2), host's wait]
    steps = [[1, 64, 9.0, 4, 0.0, 0.0, 200, 0.0, 0.0, 1.0],  # with a prompt chunk: left out
             [0, 64, 4.0, 1, 0.0, 0.0, 0, 0.0, 0.0, 0.5],  # plain: one token a request (overlapped: commits later)
             [0, 40, 5.0, 4, 0.0, 0.0, 120, 0.0, 0.0, 1.0],  # a chain: its committed tokens
             [0, 31, 4.0, 4, 0.0, 0.0, 100, 0.0, 0.0, 1.0],  # fewer than half of 64: the tail
             [0, 0, 1.0, None, None, None, 0, None, None, 0.0]]  # nothing decoding
    rate, share = load_rate(steps, 64)
    assert rate == pytest.approx((64 + 120) / (64 * 4.0 + 40 * 5.0))
    assert share == pytest.approx(9.0 / 13.0)
    assert load_rate(steps, 1)[1] == 1.0  # at concurrency 1 every decoding step counts
    assert load_rate(steps, 256) is None  # no step ran 128 requests or more


def test_steps_with_prompts_are_listed_by_the_requests_they_admitted_beside_the_decode_only_steps_at_load():
    decode = [[0, 64, ms, 4, 0.0, 0.0, 200, 0.0, 0.0, 1.0, "chain 4", 0, 0] for ms in (4.0, 4.5, 5.0)]
    prompts = [[1, 63, 6.0, 4, 0.0, 0.0, 190, 0.0, 0.0, 0.0, "chain 4", 150, 1],
               [1, 63, 7.0, 4, 0.0, 0.0, 190, 0.0, 0.0, 0.0, "chain 4", 250, 1],
               [1, 60, 9.0, 4, 0.0, 0.0, 180, 0.0, 0.0, 0.0, "chain 4", 700, 4],
               [1, 0, 30.0, None, None, None, 0, None, None, 0.0, None, 8000, 64]]  # the first step: nothing decodes
    lines = prompt_step_table([("DFlash", 64, decode + prompts)]).splitlines()
    assert lines[2:] == ["| DFlash | 64 | 1 | 2 | 6.50 | 200 | 63 | 4.50 |",
                         "| DFlash | 64 | >= 4 | 1 | 9.00 | 700 | 60 | 4.50 |"]
    old_trace = [step[:11] for step in decode + prompts]  # written before prompt tokens were recorded
    assert prompt_step_table([("DFlash", 64, old_trace)]).count("\n") == 1

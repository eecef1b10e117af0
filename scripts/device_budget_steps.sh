#!/usr/bin/env bash
# Budget steps on one GPU machine, as a background job that outlives single device calls: their GPU tests (SmolLM2),
# the load benchmark with auto and auto with budget steps against plain decoding, all three engines in one process,
# rounds interleaved (math500 and the coding requests at 64 in flight, and at 128 and 256; with the stage "mixed", the
# two sets together at 64), the whole GPU test suite, then what budgets would accept on math500 and the coding
# requests on the GPU (scripts/bench_budget_shares.py; the development CPU's figures are in BENCHMARKS.md).
#   start:  mkdir -p /tmp/budget && source .gpu/setup.sh && setsid nohup bash scripts/device_budget_steps.sh \
#             > /tmp/budget/run.log 2>&1 &
#   watch:  tail /tmp/budget/run.log; results in /tmp/budget
# The GGUFs (the demo target, and SmolLM2 for the GPU tests) come as one tar in pieces in /tmp/xfer
# (ggufs.tar.part.*), or already in $SPECDEC_CACHE/gguf. Env: STAGES (default "tests math500 code all-tests shares"),
# REPEATS (rounds per level, default 3), MATH500_AT and CODE_AT (concurrencies, default "64 128" and "64 256").
set -uo pipefail
out=${BUDGET_OUT:-/tmp/budget}
default_stages="tests math500 code all-tests shares"
source scripts/device_job.sh
repeats=${REPEATS:-3}
if wanted tests; then
  stage "GPU tests of budget steps"
  SPECDEC_GPU_MODEL=smollm2-135m-instruct python3 -m pytest -q tests/gpu/test_end_to_end.py -k "budget" -rA \
    > "$out/gpu-budget.log" 2>&1
  tail -3 "$out/gpu-budget.log"
fi
load() {  # load DATASET CONCURRENCY...: AR, DFlash auto and DFlash auto+budgets, rounds interleaved
  local dataset=$1
  shift
  stage "load: $dataset at $*"
  python3 scripts/bench_load.py --model "$target" --drafter "$drafter" --verify auto budget --interleave \
    --dataset "$dataset" --requests 256 --concurrency "$@" --repeats "$repeats" --out "$out/load-$dataset.json" \
    > "$out/load-$dataset.log" 2>&1
  grep -A12 "round by round" "$out/load-$dataset.log" | tail -10
}
wanted math500 && load math500 ${MATH500_AT:-64 128}
wanted code && load code ${CODE_AT:-64 256}
wanted mixed && load mixed 64
wanted all-tests && gpu_suite
if wanted shares; then
  for dataset in math500 code; do
    stage "what budgets would accept: $dataset"
    python3 scripts/bench_budget_shares.py --model "$target" --drafter "$drafter" --dataset "$dataset" \
      --out "$out/shares-$dataset.npz" > "$out/shares-$dataset.log" 2>&1
    tail -12 "$out/shares-$dataset.log"
  done
fi
stage done

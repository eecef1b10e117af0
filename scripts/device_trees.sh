#!/usr/bin/env bash
# Verify policies on one GPU machine, as a background job that outlives single device calls: the GPU tests
# of token trees, batch-1 math500 and HumanEval with chain / tree / auto (and plain decoding), the load
# benchmark with chain and auto against plain decoding, then the whole GPU test suite.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_trees.sh > /tmp/trees/run.log 2>&1 &
#   watch:  tail /tmp/trees/run.log; results in /tmp/trees
# The GGUFs (the demo target, and SmolLM2 for the GPU tests) come as one tar in pieces in /tmp/xfer
# (ggufs.tar.part.*), or already in $SPECDEC_CACHE/gguf. Env: LIMIT (problems per batch-1 eval, default 20),
# ROUNDS (load benchmark requests per level, in multiples of the concurrency; default 2),
# STAGES (default "tests math500 load humaneval all-tests"; "steps" adds the step benchmark of chain and
# tree steps with the real target: wall vs GPU kernel time at batch 1 and 8; "b1pairs" math500 at batch 1 with
# chain and auto, alternating, twice, each pinned to one core).
set -uo pipefail
out=${TREES_OUT:-/tmp/trees}
default_stages="tests math500 load humaneval all-tests"
source scripts/device_job.sh
limit=${LIMIT:-20}
if wanted tests; then
  stage "GPU tests of token trees"
  python3 -m pytest -q tests/gpu -k "tree" -s -rA > "$out/gpu-trees.log" 2>&1
  tail -3 "$out/gpu-trees.log"
fi
eval_batch1() {  # eval_batch1 SET VERIFY [ARGS...]: one prompt at a time
  local set=$1 verify=$2
  shift 2
  stage "$set, batch 1, verify $verify"
  python3 -m eval."$set" --drafter "$drafter" --limit "$limit" --max-num-seqs 1 --verify "$verify" --no-progress \
    --output "$out/$set-b1-$verify" "$@" 2>&1 | grep -v "Loading weights" | tail -12
}
if wanted math500; then
  eval_batch1 math500 chain --baseline
  eval_batch1 math500 tree
  eval_batch1 math500 auto
fi
if wanted b1pairs; then  # chain and auto alternating, each pinned to one core: a batch-1 step waits on the host,
  # whose speed varied between processes by up to ~15% unpinned (BENCHMARKS.md)
  for round in 1 2; do
    for verify in chain auto; do
      stage "math500, batch 1, verify $verify, pinned, round $round"
      taskset -c 4 python3 -m eval.math500 --drafter "$drafter" --limit "$limit" --max-num-seqs 1 --verify "$verify" \
        --no-progress --output "$out/math500-b1-$verify-pinned-$round" 2>&1 | grep "TPOT\|verify steps"
    done
  done
fi
if wanted load; then
  stage "load, chain and auto against plain decoding"
  python3 scripts/bench_load.py --model "$target" --drafter "$drafter" --verify chain auto --overlap-steps \
    --concurrency 1 8 32 64 128 256 --rounds "${ROUNDS:-2}" --out "$out/load.json" 2>&1 | grep -v "Loading weights" \
    | tee "$out/load.md"
fi
if wanted steps; then
  stage "steps, chain and tree, wall vs kernel time"
  python3 scripts/bench_steps.py --model "$target" --drafter "$drafter" --verify chain tree --batches 1 8 \
    --fp8-batches 1 --out "$out/steps.json" 2>&1 | grep -v "Loading weights" | tail -30
fi
if wanted humaneval; then
  eval_batch1 humaneval chain
  eval_batch1 humaneval tree
  eval_batch1 humaneval auto
fi
if wanted all-tests; then
  stage "the whole GPU suite"
  python3 -m pytest -q tests/gpu -s -rA > "$out/gpu-all.log" 2>&1
  tail -3 "$out/gpu-all.log"
fi
stage done

#!/usr/bin/env bash
# Drafting ahead (each DFlash step's next draft queued before the step's tokens are read back) on one GPU machine,
# as a background job: the GPU suite, the step benchmark with drafting ahead on and off, batch-1 math500 on and off
# (the same 20 problems), and the load benchmark (DFlash auto with and without drafting ahead, plain decoding with
# and without overlapped steps).
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_draft_ahead.sh > /tmp/ahead/run.log 2>&1 &
#   watch:  tail /tmp/ahead/run.log; results in /tmp/ahead
# The GGUFs as for scripts/device_job.sh. Env: STAGES (default "tests steps batch1 load"), LEVELS (load: "8 32 64"),
# ROUNDS (load: 4).
set -uo pipefail
out=${AHEAD_OUT:-/tmp/ahead}
default_stages="tests steps batch1 load"
source scripts/device_job.sh
drafter=qwen2.5-coder-1.5b-dflash-b16
wanted tests && gpu_suite
if wanted steps; then
  for overlap in on off; do
    stage "step benchmark, drafting ahead $overlap"
    python3 scripts/bench_steps.py --batches 1 16 64 --fp8-batches 1 --verify chain --prompt-tokens 700 --repeats 5 \
      --graphs-only --overlap-steps "$overlap" --out "$out/steps-$overlap.json" 2>&1 | grep -v "Loading weights" | tail -14
  done
fi
if wanted batch1; then
  for flag in --overlap-steps --no-overlap-steps; do
    stage "math500 at batch 1, $flag"
    python3 -m eval.math500 --target "$target" --drafter "$drafter" --limit 20 --max-num-seqs 1 "$flag" \
      --no-progress --output "$out/math500-batch1$flag" 2>&1 | tail -8
  done
fi
if wanted load; then
  stage "load benchmark"
  # shellcheck disable=SC2086
  python3 scripts/bench_load.py --model "$target" --drafter "$drafter" --verify auto --overlap-steps \
    --concurrency ${LEVELS:-8 32 64} --rounds "${ROUNDS:-4}" --out "$out/load.json" 2>&1 | grep -v "Loading weights" | tail -30
fi
stage done

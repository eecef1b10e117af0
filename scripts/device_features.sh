#!/usr/bin/env bash
# The GPU suite, then what the API features cost and the prefix cache's time to first token, on one GPU
# machine as a background job that outlives single device calls.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_features.sh > /tmp/features/run.log 2>&1 &
#   watch:  tail /tmp/features/run.log; results in /tmp/features
# The GGUFs as for scripts/device_job.sh. Env: STAGES (default "tests ttft features").
set -uo pipefail
out=${FEATURES_OUT:-/tmp/features}
default_stages="tests ttft features"
source scripts/device_job.sh
wanted tests && gpu_suite
if wanted ttft; then
  stage "time to first token, prefix cache on and off"
  python3 scripts/bench_prefix_ttft.py --model "$target" --system-repeat 1 4 12 --out "$out/ttft.json" 2>&1 \
    | grep -v "Loading weights" | tail -12
fi
if wanted features; then
  stage "what logprobs and penalties cost, batch 1 and concurrency 32"
  python3 scripts/bench_features.py --model "$target" --concurrency 1 32 --out "$out/features.json" 2>&1 \
    | grep -v "Loading weights" | tail -8
fi
stage done

#!/usr/bin/env bash
# Prefix caching on one GPU machine, as a background job that outlives single device calls: the GPU test
# suite, then the multi-turn serving benchmark with the prefix cache on and off (`specdec.serve`, DFlash,
# the demo target).
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_prefix_cache.sh > /tmp/prefix/run.log 2>&1 &
#   watch:  tail /tmp/prefix/run.log; results in /tmp/prefix
# The GGUFs (the demo target, and SmolLM2 for the GPU tests) come as one tar in pieces in /tmp/xfer
# (ggufs.tar.part.*), or already in $SPECDEC_CACHE/gguf; the server's packages in .gpu/wheels. Env: STAGES
# (default "tests serve"), LEVELS (default "1 8,32"), MAX_TOKENS (256).
set -uo pipefail
out=${PREFIX_OUT:-/tmp/prefix}
default_stages="tests serve"
source scripts/device_job.sh
wanted tests && gpu_suite
if wanted serve; then
  # levels: "1 8,32" runs concurrency 1 with 6 conversations, then 8 and 32 with 64 conversations each
  for levels in ${LEVELS:-1 8,32}; do
    n=$([ "$levels" = 1 ] && echo 6 || echo 64)
    stage "multiturn, concurrency $levels, $n conversations, prefix cache on and off"
    python3 scripts/bench_serve.py --serve cache="--target $target" \
      --serve no-cache="--target $target --no-prefix-caching" --dataset multiturn --concurrency "$levels" \
      --num-prompts "$n" --max-tokens "${MAX_TOKENS:-256}" --time-limit-s 900 \
      --output "$out/multiturn-c${levels//,/-}.json" 2>&1 | grep -v "Loading weights" | tail -40
  done
fi
stage done

#!/usr/bin/env bash
# Throughput under load on one GPU machine, as a background job that outlives single device calls:
# the load benchmark at concurrency 64 for this checkout and a baseline checkout back to back (twice,
# alternating), a concurrency sweep of this checkout, the server against the library at concurrency 64,
# and batch-1 math500 with and without the drafter.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_load_bench.sh > /tmp/load/run.log 2>&1 &
#   watch:  tail /tmp/load/run.log; results in /tmp/load/*.json, *.md
# BASELINE: a directory holding the baseline's packages (e.g. `git archive <commit> attention specdec eval
# scripts drafters/*.py drafters/training | tar -x -C .bench_old`); none: no baseline runs. The target's
# GGUF must be in $SPECDEC_CACHE/gguf; the server's packages carried in .gpu/wheels (see
# scripts/device_serve_bench.sh).
set -uo pipefail
out=${LOAD_OUT:-/tmp/load}
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
here=$(pwd)
target=${TARGET:-qwen2.5-coder-1.5b-instruct}
drafter=${DRAFTER:-$here/drafters/checkpoints/qwen2.5-coder-1.5b-dflash-b16}
baseline=${BASELINE:-}
load() {  # load NAME DIR [ARGS...]: the load benchmark of the checkout in DIR (its own scripts/bench_load.py)
  local name=$1 dir=$2
  shift 2
  echo "=== $(date +%T) $name"
  (cd "$dir" && python3 scripts/bench_load.py --model "$target" --drafter "$drafter" \
    --out "$out/$name.json" "$@") 2>&1 | grep -v "Loading weights" | tee "$out/$name.md"
}
python3 -c "from specdec.weights.demo_models import resolve_model; print(resolve_model('$target'))" || exit 1
load new-1 "$here" --concurrency 64 --profile 64
[ -n "$baseline" ] && load old-1 "$baseline" --concurrency 64
load sweep "$here" --concurrency 1 8 32 64 128 256 --rounds 4
echo "=== $(date +%T) server vs library, concurrency 64"
python3 scripts/bench_serve.py --serve dflash="--target $target --drafter $drafter" \
  --serve ar="--target $target --no-drafter" --dataset mixed --concurrency 64 --num-prompts 256 \
  --max-tokens 512 --time-limit-s 600 --output "$out/serve.json" 2>&1 | tail -30
load new-2 "$here" --concurrency 64
[ -n "$baseline" ] && load old-2 "$baseline" --concurrency 64
echo "=== $(date +%T) math500, batch 1"
python3 -m eval.math500 --drafter "$drafter" --limit 40 --max-num-seqs 1 --baseline --no-progress \
  --output "$out/math500-batch1" 2>&1 | tail -15
echo "=== $(date +%T) done"

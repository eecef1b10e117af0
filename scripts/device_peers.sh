#!/usr/bin/env bash
# specdec against vLLM and SGLang on one GPU machine, as a background job that outlives single device calls:
# tests/gpu first (GPU_TESTS=0 skips them), then both peers installed from their carried wheels
# (scripts/peers/README.md) and scripts/bench_peers.py at batch 1 and concurrency 8, 32, 64, 128.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_peers.sh > /tmp/peers-run/run.log 2>&1 &
#   watch:  tail /tmp/peers-run/run.log; the JSON (rewritten after every system) in /tmp/peers-run/
# The target's GGUF must be in $SPECDEC_CACHE/gguf and the peers' wheel pieces in /tmp/xfer/.
# Systems run in the order below, the plain-decoding ones first, until DEADLINE_S (default 720) runs out.
set -uo pipefail
out=${PEERS_OUT:-/tmp/peers-run}
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
if [ "${GPU_TESTS:-1}" = 1 ]; then
  echo "=== $(date +%T) tests/gpu"
  python3 -m pytest -q tests/gpu -p no:cacheprovider > "$out/gpu-tests.log" 2>&1
  tail -2 "$out/gpu-tests.log"
fi
echo "=== $(date +%T) installing the peers"
bash scripts/peers/install.sh vllm && bash scripts/peers/install.sh sglang
echo "=== $(date +%T) bench_peers"
python3 scripts/bench_peers.py \
  --systems "${SYSTEMS:-ours-ar-overlapped,sglang-ar,vllm-ar,ours-dflash-bf16,ours-dflash-auto,vllm-dflash,ours-ar,ours-dflash-fp8}" \
  --limit 20 --seed 0 --max-new-tokens 512 --concurrency 8,32,64,128 \
  --throughput-prompts "${THROUGHPUT_PROMPTS:-128}" --deadline-s "${DEADLINE_S:-720}" \
  --peer-site vllm=/tmp/peers/vllm,sglang=/tmp/peers/sglang --out "$out/bench-peers.json" > "$out/bench.log" 2>&1
tail -40 "$out/bench.log"
echo "=== $(date +%T) done"

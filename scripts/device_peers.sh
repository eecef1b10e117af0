#!/usr/bin/env bash
# specdec against vLLM and SGLang on one GPU machine, and its server against its library, as a background job that
# outlives single device calls. Stages (env STAGES, default "peers serve tests", run in this order):
#   peers  the peers SYSTEMS names, installed from their carried wheels (scripts/peers/README.md), then
#          scripts/bench_peers.py:
#          20 math500 prompts at batch 1, the same prompts repeated to THROUGHPUT_PROMPTS (default 256) requests at
#          each of LEVELS (default 8,32,64,128,256); systems in the order of SYSTEMS until DEADLINE_S (default
#          1100: vLLM's DFlash engine build alone takes ~210 s)
#   serve  the library (scripts/bench_load.py) and the server (scripts/bench_serve.py) on the same 256 prompts of
#          bench_serve's mixed set at concurrency 64, DFlash and plain decoding, the engine's defaults
#   tests  the whole GPU suite (scripts/device_job.sh)
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_peers.sh > /tmp/peers-run/run.log 2>&1 &
#   watch:  tail /tmp/peers-run/run.log; the JSON (rewritten after every system) in /tmp/peers-run/
# The GGUFs as for scripts/device_job.sh, the peers' wheel pieces in /tmp/xfer/, the server's packages in .gpu/wheels.
set -uo pipefail
out=${PEERS_OUT:-/tmp/peers-run}
default_stages="peers serve tests"
source scripts/device_job.sh
drafter=qwen2.5-coder-1.5b-dflash-b16
systems=${SYSTEMS:-ours-dflash-auto,ours-ar-overlapped,sglang-ar,vllm-ar,vllm-dflash,ours-ar}
if wanted peers; then
  stage "installing the peers"
  for peer in vllm sglang; do  # only those SYSTEMS names (their wheel pieces alone need to be in /tmp/xfer)
    [[ ",$systems" == *",$peer-"* ]] && { bash scripts/peers/install.sh "$peer" || exit 1; }
  done
  stage "bench_peers"
  python3 scripts/bench_peers.py --systems "$systems" \
    --limit 20 --seed 0 --max-new-tokens 512 --concurrency "${LEVELS:-8,32,64,128,256}" \
    --throughput-prompts "${THROUGHPUT_PROMPTS:-256}" --deadline-s "${DEADLINE_S:-1100}" \
    --peer-site vllm=/tmp/peers/vllm,sglang=/tmp/peers/sglang --out "$out/bench-peers.json" > "$out/bench.log" 2>&1
  tail -48 "$out/bench.log"
fi
if wanted serve; then
  stage "library at concurrency 64"
  python3 scripts/bench_load.py --model "$target" --drafter "$drafter" --verify auto --overlap-steps on \
    --dataset mixed --requests 256 --concurrency 64 --out "$out/library.json" 2>&1 | grep -v "Loading weights" | tail -4
  stage "server at concurrency 64"
  python3 scripts/bench_serve.py --serve dflash="--target $target" --serve ar="--target $target --no-drafter" \
    --dataset mixed --concurrency 64 --num-prompts 256 --max-tokens 512 --time-limit-s 600 \
    --output "$out/serve.json" > "$out/serve.log" 2>&1
  tail -12 "$out/serve.log"
fi
wanted tests && gpu_suite
stage done

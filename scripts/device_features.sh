#!/usr/bin/env bash
# What the API features cost (logprobs, penalties, a JSON schema), the prefix cache's time to first token and (stage serve) the
# multi-turn serving benchmark with the prefix cache on and off (`specdec.serve`, DFlash, the demo target), on
# one GPU machine as a background job that outlives single device calls.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_features.sh > /tmp/features/run.log 2>&1 &
#   watch:  tail /tmp/features/run.log; results in /tmp/features
# The GGUFs as for scripts/device_job.sh; the server's packages in .gpu/wheels. Env: STAGES (default "tests
# ttft features"; "serve" adds the serving benchmark, "vllm" the same levels against vLLM's server with DFlash and prefix
# caching, scripts/peers/vllm_server.sh: its wheel pieces in /tmp/xfer), LEVELS (serve, vllm: default "1 8,32"),
# MAX_TOKENS (256), SYSTEM_REPEATS (serve, vllm: copies of the shared system prompt, one run each; default "1"),
# SERVE_ARGS (more server arguments for both of ours); stage "window": acceptance on long prompts per draft window
# (WINDOWS, default "0 2048"); TTFT_ARGS: bench_prefix_ttft's arguments (stage ttft).
set -uo pipefail
out=${FEATURES_OUT:-/tmp/features}
default_stages="tests ttft features"
source scripts/device_job.sh
if wanted ttft; then
  stage "time to first token, prefix cache on and off"
  # TTFT_ARGS: e.g. "--system-repeat 12 --profile 4" (the whole report in ttft.txt)
  python3 scripts/bench_prefix_ttft.py --model "$target" ${TTFT_ARGS:---system-repeat 1 4 12} --out "$out/ttft.json" 2>&1 \
    | grep -v "Loading weights" > "$out/ttft.txt"; head -12 "$out/ttft.txt"
fi
if wanted features; then
  stage "what logprobs, penalties and a JSON schema cost, batch 1 and concurrency 32"
  python3 scripts/bench_features.py --model "$target" --concurrency 1 32 --out "$out/features.json" 2>&1 \
    | grep -v "Loading weights" | tail -8
fi
if wanted serve; then
  # levels: "1 8,32" runs concurrency 1 with 6 conversations, then 8 and 32 with 64 conversations each
  for repeat in ${SYSTEM_REPEATS:-1}; do
    for levels in ${LEVELS:-1 8,32}; do
      n=$([ "$levels" = 1 ] && echo 6 || echo 64)
      stage "multiturn, system prompt x$repeat, concurrency $levels, $n conversations, prefix cache on and off"
      python3 scripts/bench_serve.py --serve cache="--target $target ${SERVE_ARGS:-}" \
        --serve no-cache="--target $target --no-prefix-caching ${SERVE_ARGS:-}" --dataset multiturn --system-repeat "$repeat" \
        --concurrency "$levels" --num-prompts "$n" --max-tokens "${MAX_TOKENS:-256}" --time-limit-s 900 \
        --output "$out/multiturn-s$repeat-c${levels//,/-}.json" 2>&1 | grep -v "Loading weights" | tail -40
    done
  done
fi
if wanted window; then  # acceptance on long prompts (the system prompt x12, ~6k tokens) against the draft window
  for window in ${WINDOWS:-0 2048}; do
    stage "long prompts, draft window $window"
    python3 scripts/bench_load.py --model "$target" --drafter qwen2.5-coder-1.5b-dflash-b16 --verify auto \
      --overlap-steps on --system-repeat 12 --draft-window "$window" --concurrency 1 8 --requests 16 \
      --max-new-tokens 256 --out "$out/window-$window.json" 2>&1 | grep -v "Loading weights" | tail -8
  done
fi
if wanted vllm; then  # the same multiturn levels against vLLM's server: DFlash, its prefix caching on
  bash scripts/peers/install.sh vllm || exit 1
  stage "vLLM's server (DFlash, prefix caching), starting"
  model_dir=$(python3 -c "from specdec.weights.demo_models import resolve_model; print(resolve_model('$target'))")
  # vLLM reads plain bf16 weights, not the shipped drafter's compact storage
  python3 scripts/export_drafter.py qwen2.5-coder-1.5b-dflash-b16 /tmp/drafter-bf16 || exit 1
  MAX_NUM_SEQS=32 bash scripts/peers/vllm_server.sh "$model_dir" /tmp/drafter-bf16 8123 || exit 1
  for repeat in ${SYSTEM_REPEATS:-1}; do
    for levels in ${LEVELS:-1 8,32}; do
      n=$([ "$levels" = 1 ] && echo 6 || echo 64)
      stage "vLLM, multiturn, system prompt x$repeat, concurrency $levels, $n conversations"
      python3 scripts/bench_serve.py --base-url http://127.0.0.1:8123 --label vllm-dflash-cache --dataset multiturn \
        --system-repeat "$repeat" --concurrency "$levels" --num-prompts "$n" --max-tokens "${MAX_TOKENS:-256}" \
        --time-limit-s 900 --output "$out/vllm-multiturn-s$repeat-c${levels//,/-}.json" 2>&1 | tail -20
    done
  done
  # the whole process group: the API server's engine process would otherwise keep the GPU's memory
  kill -- -"$(cat /tmp/vllm-server.pid)"; sleep 10
fi
wanted tests && gpu_suite  # last: the measurements come first while the machine is held
stage done

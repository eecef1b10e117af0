#!/usr/bin/env bash
# Throughput under load on one GPU machine, the engine's defaults (`verify auto`, drafting ahead, overlapped plain
# steps), as a background job that outlives single device calls. Stages (env STAGES, default "tests sweep profile"):
#   tests    the whole GPU suite (scripts/device_job.sh)
#   sweep    DFlash and plain decoding on bench_serve's math500 and coding requests at concurrency 1-256 (LEVELS),
#            each level REPEATS times (the median run reported), at most ROUNDS x concurrency requests a level; the
#            two run round by round in one process (--interleave), each round's ratio reported; MAX_NEW_TOKENS
#            caps each answer (bench_load.py's default, 512, where unset; math500's protocol allows 2048); VERIFY
#            the DFlash rows' policies (bench_load.py's --verify, default auto)
#   sustained  DFlash and plain decoding under sustained load (a finished request replaced by the next): all 500
#            math500 problems at 64 in flight (3 repeats), 1,024 coding requests at 256 (2 repeats); the levels of
#            `sweep` drain at the end (2 x C requests), which favours speculation in their tails; VERIFY as for `sweep`
#   profile  where a step's time goes (wall against GPU busy time, the largest kernels): steps with and without
#            arrivals at 64 on the mixed set, and at 256 on the coding requests
#   host-profile  where a step's host time goes (cProfile, per kind of step): math500 at 64, coding requests at 256
#   profile-batch1  the same for one request: chain and tree steps on math500, and turns whose ~6k-token system
#            prompt the prefix cache holds (--system-repeat 12)
#   ab       this checkout against BASELINE on math500 and the coding requests at AB_LEVELS (64 128 256),
#            alternating, twice (the second time the baseline first)
#   ab-sustained  this checkout against BASELINE under sustained load: all 500 math500 problems at 64 in flight, as
#            `sustained` (2 repeats a process), new then old, then old then new
#   ab-prefill  this checkout against BASELINE where prompts and long contexts meet: arrival steps at 64 (mixed set),
#            ~6k-token prompts at 1 and 8 (--system-repeat 12), a turn's time to first token with the prefix cache
#            (bench_prefix_ttft.py); new then old, then (with ROUNDS_AB=2) old then new
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_load_bench.sh > /tmp/load/run.log 2>&1 &
#   watch:  tail /tmp/load/run.log; results in /tmp/load/*.json, *.md
# The GGUFs as for scripts/device_job.sh. BASELINE: a directory holding the baseline's packages (e.g. `git archive
# <commit> attention specdec eval scripts drafters/*.py drafters/training | tar -x -C .bench_old`).
set -uo pipefail
out=${LOAD_OUT:-/tmp/load}
default_stages="tests sweep profile"
no_target_stages="tests"  # the GPU suite runs on SmolLM2 alone
source scripts/device_job.sh
here=$(pwd)
drafter=$here/drafters/checkpoints/qwen2.5-coder-1.5b-dflash-b16
load() {  # load NAME DIR [ARGS...]: the load benchmark of the checkout in DIR (its own scripts/bench_load.py)
  local name=$1 dir=$2
  shift 2
  stage "$name"
  (cd "$dir" && python3 scripts/bench_load.py --model "$target" --drafter "$drafter" --verify auto \
    --overlap-steps on --out "$out/$name.json" "$@") 2>&1 | grep -v "Loading weights" | tee "$out/$name.md" | tail -16
}
wanted tests && gpu_suite
if wanted sweep; then
  for dataset in math500 code; do
    # shellcheck disable=SC2086
    load "sweep-$dataset" "$here" --dataset "$dataset" --concurrency ${LEVELS:-1 8 32 64 128 256} \
      --repeats "${REPEATS:-3}" --rounds "${ROUNDS:-8}" --interleave \
      ${MAX_NEW_TOKENS:+--max-new-tokens "$MAX_NEW_TOKENS"} ${VERIFY:+--verify $VERIFY}
  done
fi
if wanted sustained; then
  # shellcheck disable=SC2086
  load sustained-math500-64 "$here" --dataset math500 --concurrency 64 --requests 500 --rounds 8 --repeats 3 \
    --interleave ${VERIFY:+--verify $VERIFY}
  # shellcheck disable=SC2086
  load sustained-code-256 "$here" --dataset code --concurrency 256 --requests 1024 --rounds 4 --repeats 2 \
    --interleave ${VERIFY:+--verify $VERIFY}
fi
if wanted profile; then
  load profile-arrivals "$here" --dataset mixed --concurrency 64 --profile 64
  load profile-code-256 "$here" --dataset code --concurrency 256 --profile 256
fi
if wanted host-profile; then
  load host-profile-math500-64 "$here" --dataset math500 --concurrency 64 --host-profile 64
  load host-profile-code-256 "$here" --dataset code --concurrency 256 --host-profile 256
fi
if wanted profile-batch1; then
  load profile-trees "$here" --dataset math500 --verify chain tree --requests 4 --max-new-tokens 256 --concurrency 1 \
    --profile 1
  load profile-long "$here" --system-repeat 12 --requests 8 --max-new-tokens 64 --concurrency 1 --profile 1
fi
if wanted ab && [ -n "${BASELINE:-}" ]; then
  # the second round runs the baseline first: a machine that drifts during the job favours neither side
  for round in 1 2; do
    for dataset in math500 code; do
      sides="new old"
      [ "$round" = 2 ] && sides="old new"
      for side in $sides; do
        dir=$here
        [ "$side" = old ] && dir=$BASELINE
        # shellcheck disable=SC2086
        load "$side-$dataset-$round" "$dir" --dataset "$dataset" --concurrency ${AB_LEVELS:-64 128 256}
      done
    done
  done
fi
if wanted ab-sustained && [ -n "${BASELINE:-}" ]; then
  round=0
  for side in new old old new; do
    round=$((round + 1))
    dir=$here
    [ "$side" = old ] && dir=$BASELINE
    load "$side-sustained-math500-$round" "$dir" --dataset math500 --concurrency 64 --requests 500 --rounds 8 \
      --repeats 2 --interleave
  done
fi
if wanted ab-prefill && [ -n "${BASELINE:-}" ]; then
  sides="new old"
  [ "${ROUNDS_AB:-1}" = 2 ] && sides="new old old new"
  round=0
  for side in $sides; do
    round=$((round + 1))
    dir=$here
    [ "$side" = old ] && dir=$BASELINE
    load "$side-arrivals-$round" "$dir" --dataset mixed --concurrency 64
    load "$side-long-$round" "$dir" --system-repeat 12 --concurrency 1 8 --requests 16 --max-new-tokens 256
    stage "$side-ttft-$round"
    (cd "$dir" && python3 scripts/bench_prefix_ttft.py --model "$target" --drafter "$drafter" --system-repeat 1 12 \
      --out "$out/$side-ttft-$round.json") 2>&1 | grep -v "Loading weights" | tee "$out/$side-ttft-$round.md" | tail -12
  done
fi
stage done

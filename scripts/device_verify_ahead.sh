#!/usr/bin/env bash
# A lone request's verify queued ahead (EngineConfig.verify_ahead) on one GPU machine, as a background job that outlives
# single device calls: its GPU tests (the bits of every start a plan serves; batch-1 exactness with it on), the whole GPU
# suite with it on by default there, a chain step at batch 1 with and without it (random weights of the default target's
# shape), and math500 at batch 1 with the chain and auto, with and without it, and with a 15-node tree, each run pinned
# to one core; stage "profiles": math500 at batch 1 under cProfile (in order, ahead, 15-node trees), host time per
# verify step by function (PROFILE_LIMIT problems, default 6).
#   start:  mkdir -p /tmp/ahead && source .gpu/setup.sh && setsid nohup bash scripts/device_verify_ahead.sh \
#             > /tmp/ahead/run.log 2>&1 &
#   watch:  tail /tmp/ahead/run.log; results in /tmp/ahead
# The GGUFs (the demo target, and SmolLM2 for the GPU tests) come as one tar in pieces in /tmp/xfer
# (ggufs.tar.part.*), or already in $SPECDEC_CACHE/gguf; stages "tests steps all-tests" need only SmolLM2's.
# Env: STAGES (default "tests steps all-tests math500"), LIMIT (problems per batch-1 eval, default 20).
set -uo pipefail
out=${AHEAD_OUT:-/tmp/ahead}
default_stages="tests steps all-tests math500"
no_target_stages="tests steps all-tests"
source scripts/device_job.sh
limit=${LIMIT:-20}
if wanted tests; then
  stage "GPU tests of verifies planned for a later start, and batch-1 exactness with verify_ahead on"
  SPECDEC_GPU_MODEL=smollm2-135m-instruct python3 -m pytest -q tests/gpu/test_flashinfer_backend.py \
    -k "later_start or verify_rows" -rA > "$out/gpu-rows.log" 2>&1
  tail -3 "$out/gpu-rows.log"
fi
if wanted steps; then
  for ahead in "" --verify-ahead; do
    stage "a chain step at batch 1 ${ahead:-in order}"
    taskset -c 4 python3 scripts/bench_steps.py --batches 1 --fp8-batches 1 --verify chain --graphs-only \
      --max-new-tokens 512 --host-functions 40 $ahead --out "$out/steps-b1${ahead:+-ahead}.json" \
      > "$out/steps-b1${ahead:+-ahead}.md" 2> "$out/steps-b1${ahead:+-ahead}.err"
    sed -n '/^| system/,/^$/p' "$out/steps-b1${ahead:+-ahead}.md"  # the main table (the host functions' follow)
  done
fi
if wanted all-tests; then  # the whole suite with the setting on wherever an engine is made without it
  sed -i 's/verify_ahead: bool = _setting(False,/verify_ahead: bool = _setting(True,/' specdec/engine/config.py
  gpu_suite
  sed -i 's/verify_ahead: bool = _setting(True,/verify_ahead: bool = _setting(False,/' specdec/engine/config.py
fi
if wanted math500; then
  eval_batch1 chain --verify chain --baseline
  eval_batch1 chain-ahead --verify chain --verify-ahead
  eval_batch1 auto --verify auto
  eval_batch1 auto-ahead --verify auto --verify-ahead
  eval_batch1 tree --verify tree --tree-nodes 15
fi
if wanted profiles; then  # where the host's time goes on real requests: in order, verify ahead, 15-node trees
  for run in "profiled-chain --verify chain" "profiled-chain-ahead --verify chain --verify-ahead" \
             "profiled-tree --verify tree --tree-nodes 15"; do
    PROFILE=1 limit=${PROFILE_LIMIT:-6} eval_batch1 $run
  done
fi

#!/usr/bin/env bash
# A lone request's tree and chain steps with their small tensor work fused (attention/fused.py) on one GPU machine, as
# a background job that outlives single device calls: a step at batch 1 (chain and 15-node tree, random weights of
# the default target's shape) fused, unfused and fused again (the first fused run compiles cold, the second finds
# inductor's cache), each fused piece alone (scripts/bench/tree_fusion_probe.py), the GPU tests of lone trees and
# query rows, the whole GPU suite, and math500 at batch 1 on the real
# target (chain, tree, auto, each also unfused), each run pinned to one core.
#   start:  mkdir -p /tmp/fused && source .gpu/setup.sh && setsid nohup bash scripts/device_fused.sh \
#             > /tmp/fused/run.log 2>&1 &
#   watch:  tail /tmp/fused/run.log; results in /tmp/fused
# Env: STAGES (default "steps probe tests all-tests math500"), LIMIT (problems per batch-1 eval, default 20), STEP_RUNS
# (default "fused-cold:1 unfused:0 fused:1": name:SPECDEC_FUSED_KERNELS), STEP_TOKENS (default 512).
set -uo pipefail
out=${FUSED_OUT:-/tmp/fused}
default_stages="steps probe tests all-tests math500"
no_target_stages="steps probe tests all-tests"
source scripts/device_job.sh
limit=${LIMIT:-20}
export SPECDEC_FUSED_KERNELS=${SPECDEC_FUSED_KERNELS:-1}  # the tests' engines fused
if wanted steps; then
  for run in ${STEP_RUNS:-fused-cold:1 unfused:0 fused:1}; do
    name=${run%%:*}
    stage "a chain and a tree step at batch 1, $name"
    SPECDEC_FUSED_KERNELS=${run##*:} taskset -c 4 python3 scripts/bench_steps.py --batches 1 --fp8-batches \
      --verify chain tree --graphs-only --max-new-tokens ${STEP_TOKENS:-512} --out "$out/steps-$name.json" \
      > "$out/steps-$name.md" 2> "$out/steps-$name.err"
    sed -n '/^| system/,/^$/p' "$out/steps-$name.md"
    grep -i "capture" "$out/steps-$name.md" | tail -1
  done
fi
if wanted probe; then  # each fused piece alone, as written and compiled (kernels, GPU us, same values)
  stage "the fused pieces alone"
  python3 scripts/bench/tree_fusion_probe.py 2>&1 | grep "^|" | tee "$out/probe.md"
fi
if wanted tests; then
  stage "GPU tests of lone trees and query rows, SPECDEC_FUSED_KERNELS=$SPECDEC_FUSED_KERNELS"
  SPECDEC_GPU_MODEL=smollm2-135m-instruct python3 -m pytest -q tests/gpu/test_end_to_end.py \
    tests/gpu/test_flashinfer_backend.py -k "tree or batch_one or lone or rows" -rA > "$out/gpu-lone.log" 2>&1
  tail -3 "$out/gpu-lone.log"
fi
if wanted all-tests; then
  gpu_suite
fi
if wanted math500; then
  eval_batch1 chain --verify chain --baseline
  eval_batch1 tree --verify tree --tree-nodes 15
  SPECDEC_FUSED_KERNELS=0 eval_batch1 tree-unfused --verify tree --tree-nodes 15
  eval_batch1 auto --verify auto
  SPECDEC_FUSED_KERNELS=0 eval_batch1 auto-unfused --verify auto
  SPECDEC_FUSED_KERNELS=0 eval_batch1 chain-unfused --verify chain
fi

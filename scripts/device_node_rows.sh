#!/usr/bin/env bash
# A lone request's small token trees as node rows on one GPU machine, as a background job that outlives single device
# calls: their GPU tests (SmolLM2), math500 and HumanEval at batch 1 with the chain, trees (a lone request's: 15 nodes,
# node rows, whatever --tree-nodes asks) and auto, each run pinned to one core; a chain step's and a tree step's wall
# and kernel time at batch 1 (random weights of the default target's shape); then the whole GPU test suite.
#   start:  mkdir -p /tmp/nodes && source .gpu/setup.sh && setsid nohup bash scripts/device_node_rows.sh \
#             > /tmp/nodes/run.log 2>&1 &
#   watch:  tail /tmp/nodes/run.log; results in /tmp/nodes
# The GGUFs (the demo target, and SmolLM2 for the GPU tests) come as one tar in pieces in /tmp/xfer
# (ggufs.tar.part.*), or already in $SPECDEC_CACHE/gguf; stages "tests steps all-tests" alone need only SmolLM2's.
# Env: STAGES (default "tests math500 steps all-tests humaneval"), LIMIT (problems per batch-1 eval, default 20).
set -uo pipefail
out=${NODES_OUT:-/tmp/nodes}
default_stages="tests math500 steps all-tests humaneval"
no_target_stages="tests steps all-tests"  # SmolLM2 and random weights: these need only the SmolLM2 GGUF
source scripts/device_job.sh
limit=${LIMIT:-20}
if wanted tests; then
  stage "GPU tests of token trees and lone requests"
  SPECDEC_GPU_MODEL=smollm2-135m-instruct python3 -m pytest -q tests/gpu/test_end_to_end.py \
    tests/gpu/test_flashinfer_backend.py -k "tree or batch_one or lone" -s -rA > "$out/gpu-trees.log" 2>&1
  tail -3 "$out/gpu-trees.log"
fi
eval_batch1() {  # eval_batch1 SET NAME [ARGS...]: one prompt at a time, pinned to one core
  local set=$1 name=$2
  shift 2
  stage "$set, batch 1, $name"
  taskset -c 4 python3 -m eval."$set" --drafter "$drafter" --limit "$limit" --max-num-seqs 1 --no-progress \
    --output "$out/$set-b1-$name" "$@" 2>&1 | grep -v "Loading weights" | tail -8
}
batch1_set() {  # batch1_set SET [ARGS of the chain's run...]
  local set=$1
  shift
  eval_batch1 "$set" chain --verify chain "$@"
  eval_batch1 "$set" tree --verify tree
  eval_batch1 "$set" auto --verify auto
}
wanted math500 && batch1_set math500 --baseline
if wanted steps; then
  stage "a chain step and a tree step at batch 1, wall and kernel time"
  taskset -c 4 python3 scripts/bench_steps.py --batches 1 --fp8-batches --verify chain tree --graphs-only \
    --out "$out/steps-b1.json" 2>&1 | grep -v "Loading weights" | tail -20
fi
wanted all-tests && gpu_suite
wanted humaneval && batch1_set humaneval

#!/usr/bin/env bash
# One device call: GPU tests plus a short step benchmark, with a pass/fail summary.
#   source .gpu/setup.sh && bash scripts/gpu_check.sh [model]
# The demo model's GGUF must be in $SPECDEC_CACHE/gguf (the device has no network) or in /tmp/xfer.
set -uo pipefail
model=${1:-smollm2-135m-instruct}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} SPECDEC_REPORT_DIR=$out SPECDEC_GPU_MODEL=$model
mkdir -p "$SPECDEC_CACHE/gguf"
for f in /tmp/xfer/*.gguf.part.000; do  # reassemble a carried GGUF once
  [ -e "$f" ] || continue
  name=$(basename "$f" .part.000)
  [ -s "$SPECDEC_CACHE/gguf/$name" ] || cat /tmp/xfer/"$name".part.* > "$SPECDEC_CACHE/gguf/$name"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -m pytest -q tests/gpu -s -rA 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
# the CLI with a (random-weight) DFlash drafter and an FP8 KV cache, through FlashInfer
python3 - <<'PY'
import sys; sys.path.insert(0, ".")
import os
import torch
from transformers import AutoConfig
from specdec.weights.demo_models import resolve_model
from drafters.training.drafter_config import DrafterShape, save_random_drafter
save_random_drafter("/tmp/random-drafter", AutoConfig.from_pretrained(resolve_model(os.environ["SPECDEC_GPU_MODEL"])),
                    DrafterShape(num_layers=2, heads=8, kv_heads=2, head_dim=64, intermediate_size=1024, block_size=16),
                    mask_token_id=0, std=0.02, dtype=torch.float32)
PY
python3 -m specdec.generate --target "$model" --drafter /tmp/random-drafter --kv-cache-dtype fp8 \
  --max-new-tokens 48 --prompt "Name three prime numbers." 2>&1 | tee "$out/cli.log"
cli_rc=${PIPESTATUS[0]}
python3 scripts/bench_steps.py --model "$model" --drafter /tmp/random-drafter --out "$out/bench.json" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "SUMMARY: gpu tests $([ "$tests_rc" = 0 ] && echo PASS || echo FAIL) (rc $tests_rc), CLI rc $cli_rc, benchmark rc $bench_rc"

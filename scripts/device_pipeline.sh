#!/usr/bin/env bash
# Drafter pipeline on one GPU machine, as a background job that outlives single device calls:
# reassemble + verify the target GGUF, generate training data (math, code, general prompts), train, export,
# evaluate on math500 and HumanEval.
#   start:  source .gpu/setup.sh && setsid nohup bash scripts/device_pipeline.sh > /tmp/run/pipeline.log 2>&1 &
#   watch:  tail /tmp/run/pipeline.log /tmp/run/stage
# Stages write /tmp/run/stage; every stage is resumable (re-running the script continues).
# Env: DATA_BUDGET_S, TRAIN_BUDGET_S, TRAIN_STEPS, MATH500 (path of math500.jsonl), PROBLEMS (the MATH
# training problems; ../shared does not travel to the device, so carry it, e.g. in .xfer/), SOURCES (the
# prompt mix, default "math:7500 code:6000 general:2000"), SAMPLES (sampled answers per prompt, default 1;
# 0 = greedy answers only) and TEMPERATURES (default 0.7,1.0), SEED (prompt selection and order, sampled
# answers; default 0), BATCH (requests decoded together while generating, default 256), GEN_PROCS (engines
# generating at once on the GPU, default 1) and GEN_KV_PAGES (each one's KV pages when several), INIT_FROM (an exported drafter to start
# training from), LR, HUMANEVAL_CONCURRENCY (default 1: HumanEval at batch 1 gives the TPOT speedup and
# the identical-outputs check). Shards already in /tmp/run/data (e.g. carried from an earlier run) are
# kept: the data stage only generates the missing ones. STOP_AFTER=data|train|export|pack ends the job after
# that stage. The pack stage writes $run/back/run-back.tar.xz.part.* (shards, drafter, logs; 15 MiB pieces):
# carried to another machine's /tmp/xfer, the assemble stage unpacks them into $run, so training goes on
# there (INIT_FROM=/tmp/run/drafter-bf16) with the data already generated.
set -uo pipefail
run=/tmp/run
mkdir -p "$run"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
target=qwen2.5-coder-1.5b-instruct
gguf=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
stage() {
  [ -n "${STOP_AFTER:-}" ] && [ "$STOP_AFTER" = "${current:-}" ] && { echo "stopped after ${current}" > "$run/stage"; exit 0; }
  current=$1; echo "$1" > "$run/stage"; echo "=== $(date +%T) $1"
}
fail() { echo "failed: $1" > "$run/stage"; echo "=== $(date +%T) failed: $1"; exit 1; }

stage assemble
if ls /tmp/xfer/run-back.tar.xz.part.* > /dev/null 2>&1 && [ ! -e "$run/.unpacked" ]; then
  # an earlier machine's `pack` (carried here in pieces): its shards, drafter and logs continue here
  cat /tmp/xfer/run-back.tar.xz.part.* | tar xJf - -C "$run" || fail "unpack"
  touch "$run/.unpacked"
fi
mkdir -p "$SPECDEC_CACHE/gguf"
if [ ! -s "$SPECDEC_CACHE/gguf/$gguf" ]; then
  cat /tmp/xfer/"$gguf".part.* > "$run/$gguf" || fail "reassemble"
  echo "$sha  $run/$gguf" | sha256sum -c - || fail sha256
  mv "$run/$gguf" "$SPECDEC_CACHE/gguf/$gguf"
fi
python3 -c "from specdec.models.demo_models import resolve_model; print(resolve_model('$target'))" || fail "convert"

stage data
sources=()
for s in ${SOURCES:-math:7500 code:6000 general:2000}; do sources+=(--source "$s"); done
shard=512  # prompts per shard; several engines split the list on shard boundaries
generate=(python3 scripts/generate_training_data.py --out "$run/data" --target "$target" --max-new-tokens 1024
  --problems "${PROBLEMS:-.xfer/math_train.jsonl}" "${sources[@]}"
  --samples-per-problem "${SAMPLES:-1}" --temperature "${TEMPERATURES:-0.7,1.0}" --seed "${SEED:-0}"
  --shard-size "$shard" --batch-size "${BATCH:-256}" --time-budget-s "${DATA_BUDGET_S:-420}")
procs=${GEN_PROCS:-1}
if [ "$procs" -le 1 ]; then
  "${generate[@]}" || fail "data"
else
  # decoding is host-bound (the GPU idles ~40% of a step): several engines on one GPU, each answering its
  # own range of shards with its own KV pool, keep it busier
  "${generate[@]}" --prompts-only || fail "prompts"
  total=$(wc -l < "$run/data/prompts.jsonl")
  per=$(( (total + procs * shard - 1) / (procs * shard) * shard ))
  pids=()
  for ((i = 0; i < procs; i++)); do
    "${generate[@]}" --start $((i * per)) --limit "$per" --num-kv-pages "${GEN_KV_PAGES:-32768}" \
      > "$run/data-$i.log" 2>&1 & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || fail "data (see $run/data-*.log)"; done
  tail -n 5 "$run"/data-*.log
fi

stage train
python3 scripts/train_drafter.py --data "$run/data" --out "$run/train" --target "$target" \
  --max-steps "${TRAIN_STEPS:-4000}" --batch-size 8 --anchors-per-seq 256 --eval-every 500 --save-every 500 \
  --lr "${LR:-6e-4}" ${INIT_FROM:+--init-from "$INIT_FROM"} \
  --time-budget-s "${TRAIN_BUDGET_S:-720}" --resume || fail "train"

stage export
python3 scripts/export_drafter.py "$run/train" "$run/drafter-bf16" --storage bf16 || fail "export"
python3 scripts/export_drafter.py "$run/train" "$run/drafter-fp8" --storage fp8 || fail "export"

stage pack
# what a later machine needs to go on without generating the data again, in pieces that fit one device
# call's returned files (16 MiB each): the shards, the prompt list, the drafter (bf16, for --init-from)
# and the logs. Bring $run/back/* home, carry them to the next machine as /tmp/xfer/run-back.tar.xz.part.*
rm -rf "$run/back" && mkdir -p "$run/back"
(cd "$run" && tar cf - --transform 's|^train/log.jsonl|previous-train-log.jsonl|' data drafter-bf16 drafter-fp8 \
  train/log.jsonl $(ls data-*.log 2>/dev/null) | xz -T0 -3 \
  | split -b 15M -d -a 3 - back/run-back.tar.xz.part.) || fail "pack"
ls -l "$run/back"

stage eval
python3 -m eval.math500 --target "$target" --drafter "$run/drafter-fp8" --data "${MATH500:-eval/data/math500.jsonl}" \
  --concurrency 64 --baseline --output "$run/eval" --no-progress || fail "eval"
python3 -m eval.humaneval --target "$target" --drafter "$run/drafter-fp8" \
  --concurrency "${HUMANEVAL_CONCURRENCY:-1}" --baseline --output "$run/eval-humaneval" --no-progress || fail "eval humaneval"
stage done

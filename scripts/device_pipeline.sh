#!/usr/bin/env bash
# Drafter pipeline on one GPU machine, as a background job that outlives single device calls:
# reassemble + verify the target GGUF, generate training data (math, code, general prompts), train, export,
# evaluate on math500 and HumanEval.
#   start:  cp -r . /tmp/repo && cd /tmp/repo && source .gpu/setup.sh && \
#           setsid nohup bash scripts/device_pipeline.sh > /tmp/run/pipeline.log 2>&1 &
#   (from a copy, with its inputs such as PROBLEMS under /tmp: each later device call lays the working tree
#   anew and drops the ignored paths that call does not carry, e.g. .xfer/ and .gpu/)
#   watch:  tail /tmp/run/pipeline.log /tmp/run/stage /tmp/run/train-*.log
# Stages write /tmp/run/stage; every stage is resumable (re-running the script continues).
# Env: RUN_DIR (default /tmp/run), TARGET (default the demo target), DATA_BUDGET_S, TRAIN_BUDGET_S, TRAIN_STEPS, EVAL_EVERY, MATH500 (path of math500.jsonl), PROBLEMS (the
# MATH training problems; ../shared does not travel to the device, so carry it, e.g. in .xfer/), SOURCES (the
# prompt mix, default "math:7500 code:6000 general:2000"), EXCLUDE (prompts.recipe.json files of earlier data
# whose prompts the new list leaves out), SAMPLES (sampled answers per prompt, default 1; 0 = greedy answers
# only), NO_GREEDY=1 (sampled answers only) and TEMPERATURES (default 0.7,1.0), SEED (prompt selection and
# order, sampled answers; default 0),
# BATCH (requests decoded together while generating, default 256), GEN_PROCS (engines generating at once on
# the GPU, default 1) and GEN_KV_PAGES (each one's KV pages when several), INIT_FROM (an exported drafter to
# start training from), LR, VARIANTS (drafters trained side by side on the one GPU from the same data,
# "NAME:STORAGE:TRAIN ARGS;..." e.g. "base:fp8:;deep:q5_0:--draft-layers 3 --target-layer-ids 1,13,25"; the
# train args given with INIT_FROM grow it; default "main:fp8:"; the first is the one evaluated), TRAIN_ARGS
# (more train_drafter.py flags for every variant's training and scoring, e.g. --eval-fraction 0.02),
# HUMANEVAL_CONCURRENCY (default 1: HumanEval at batch 1 gives the TPOT speedup and the identical-outputs
# check), DATA (the directory under $RUN_DIR the data stage writes, default data; another name, e.g.
# data-math-t07, keeps a second prompt list beside the first). Training and scoring read every directory
# $RUN_DIR/data and $RUN_DIR/data-*/ that holds shards (carried ones too). Shards already in $DATA (e.g.
# carried from an earlier run) are kept: the data stage only generates the missing ones.
# STOP_AFTER=data|train|export|pack ends the job after that stage; START_AT=train
# skips the data stage (the shards came along) — the assemble stage runs on every machine. The export
# stage writes each variant as $run/drafter-NAME (its STORAGE), -bf16 and -q8_0, and scores the first two on
# the held-out data ($run/score-NAME*/log.jsonl: what the storage costs). The pack stage writes
# $run/back/run-back.tar.xz.part.* (shards, each variant's drafter as q8_0 or, trained --quant-aware in its
# storage, as stored; logs; 15 MiB pieces): carried to another machine's /tmp/xfer, the assemble stage
# unpacks them into $run, so training goes on there (INIT_FROM=/tmp/run/drafter-NAME-q8_0 or -STORAGE) with
# the data already generated.
set -uo pipefail
run=${RUN_DIR:-/tmp/run}
mkdir -p "$run"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1
demo=qwen2.5-coder-1.5b-instruct
target=${TARGET:-$demo}  # another target (an HF directory) skips the GGUF steps
gguf=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
stages=(assemble data train export pack eval)
stage() {
  [ -n "${STOP_AFTER:-}" ] && [ "$STOP_AFTER" = "${current:-}" ] && { echo "stopped after ${current}" > "$run/stage"; exit 0; }
  current=$1; echo "$1" > "$run/stage"; echo "=== $(date +%T) $1"
}
wanted() {  # is stage $1 at or after START_AT (default: every stage)?
  local s
  for s in "${stages[@]}"; do
    [ "$s" = "${START_AT:-assemble}" ] && return 0
    [ "$s" = "$1" ] && return 1
  done
  return 1
}
fail() { echo "failed: $1" > "$run/stage"; echo "=== $(date +%T) failed: $1"; exit 1; }

stage assemble
if ls /tmp/xfer/run-back.tar.xz.part.* > /dev/null 2>&1 && [ ! -e "$run/.unpacked" ]; then
  # an earlier machine's `pack` (carried here in pieces): its shards, drafter and logs continue here
  cat /tmp/xfer/run-back.tar.xz.part.* | tar xJf - -C "$run" || fail "unpack"
  touch "$run/.unpacked"
fi
mkdir -p "$SPECDEC_CACHE/gguf"
if [ "$target" = "$demo" ] && [ ! -s "$SPECDEC_CACHE/gguf/$gguf" ]; then
  cat /tmp/xfer/"$gguf".part.* > "$run/$gguf" || fail "reassemble"
  echo "$sha  $run/$gguf" | sha256sum -c - || fail sha256
  mv "$run/$gguf" "$SPECDEC_CACHE/gguf/$gguf"
fi
python3 -c "from specdec.weights.demo_models import resolve_model; print(resolve_model('$target'))" || fail "convert"

stage data
if wanted data; then
data=$run/${DATA:-data}
sources=()
for s in ${SOURCES:-math:7500 code:6000 general:2000}; do sources+=(--source "$s"); done
shard=512  # prompts per shard; several engines split the list on shard boundaries
generate=(python3 scripts/generate_training_data.py --out "$data" --target "$target" --max-new-tokens 1024
  --problems "${PROBLEMS:-.xfer/math_train.jsonl}" "${sources[@]}"
  --samples-per-problem "${SAMPLES:-1}" ${NO_GREEDY:+--no-greedy} --temperature "${TEMPERATURES:-0.7,1.0}" --seed "${SEED:-0}"
  $(for r in ${EXCLUDE:-}; do printf -- '--exclude-recipe %s ' "$r"; done)
  --shard-size "$shard" --batch-size "${BATCH:-256}" --time-budget-s "${DATA_BUDGET_S:-420}")
procs=${GEN_PROCS:-1}
if [ "$procs" -le 1 ]; then
  "${generate[@]}" || fail "data"
else
  # decoding is host-bound (the GPU idles ~40% of a step): several engines on one GPU, each answering its
  # own range of shards with its own KV pool, keep it busier
  "${generate[@]}" --prompts-only || fail "prompts"
  total=$(wc -l < "$data/prompts.jsonl")
  per=$(( (total + procs * shard - 1) / (procs * shard) * shard ))
  pids=()
  for ((i = 0; i < procs; i++)); do
    "${generate[@]}" --start $((i * per)) --limit "$per" --num-kv-pages "${GEN_KV_PAGES:-32768}" \
      > "$data-$i.log" 2>&1 & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || fail "data (see $data-*.log)"; done
  tail -n 5 "$data"-*.log
fi
fi

IFS=';' read -ra variants <<< "${VARIANTS:-main:fp8:}"
name_of() { echo "${1%%:*}"; }
storage_of() { local rest=${1#*:}; echo "${rest%%:*}"; }
args_of() { local rest=${1#*:}; echo "${rest#*:}"; }
side_by_side() {  # run "$@ NAME STORAGE ARGS" for every variant at once; fail if any fails
  local pids=() v
  for v in "${variants[@]}"; do "$@" "$(name_of "$v")" "$(storage_of "$v")" "$(args_of "$v")" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid" || return 1; done
}

# every shard directory under $run trains together: this run's and any carried from earlier runs
shard_dirs=()
for d in "$run"/data "$run"/data-*/; do ls "${d%/}"/shard-*.safetensors > /dev/null 2>&1 && shard_dirs+=("${d%/}"); done

stage train
[ ${#shard_dirs[@]} -gt 0 ] || fail "no training shards in $run/data or $run/data-*/"
echo "training data: ${shard_dirs[*]}"
wanted train || fail "START_AT=${START_AT} is not one of: ${stages[*]:1:2}"
train() {  # NAME STORAGE ARGS
  python3 scripts/train_drafter.py --data "${shard_dirs[@]}" --out "$run/train-$1" --target "$target" \
    --max-steps "${TRAIN_STEPS:-4000}" --batch-size 8 --anchors-per-seq 256 --eval-every "${EVAL_EVERY:-500}" \
    --save-every 500 --lr "${LR:-6e-4}" ${INIT_FROM:+--init-from "$INIT_FROM"} $3 \
    --time-budget-s "${TRAIN_BUDGET_S:-720}" --resume ${TRAIN_ARGS:-} > "$run/train-$1.log" 2>&1
}
side_by_side train || fail "train (see $run/train-*.log)"
tail -n 4 "$run"/train-*.log

stage export
export_one() {  # NAME STORAGE ARGS: the shipped storage, bf16 (peers) and q8_0 (to carry); score the first two
  for s in "$2" bf16 q8_0; do
    python3 scripts/export_drafter.py "$run/train-$1" "$run/drafter-$1-$s" --storage "$s" || return 1
    # its tokens ranked by the answers it learned from (for --draft-vocab)
    python3 scripts/rank_draft_tokens.py "$run/drafter-$1-$s" --target "$target" --data "${shard_dirs[@]}" || return 1
  done
  ln -sfn "drafter-$1-$2" "$run/drafter-$1"
  for s in "$2" bf16; do
    python3 scripts/train_drafter.py --data "${shard_dirs[@]}" --out "$run/score-$1-$s" --target "$target" \
      --init-from "$run/drafter-$1-$s" --eval-only ${TRAIN_ARGS:-} > "$run/score-$1-$s.log" 2>&1 || return 1
  done
}
side_by_side export_one || fail "export (see $run/score-*.log)"
for f in "$run"/score-*/log.jsonl; do echo "$f: $(cut -c1-400 "$f")"; done

stage pack
# what a later machine needs to go on without generating the data again, in pieces that fit one device
# call's returned files (16 MiB each): the shards, the prompt list, the drafters (for --init-from: q8_0, or
# the variant's own storage when it trained --quant-aware in it) and the logs. Bring $run/back/* home,
# carry them to the next machine as /tmp/xfer/run-back.tar.xz.part.*
carried=()
for v in "${variants[@]}"; do  # a quant-aware variant's own storage is exactly what it trained; others go as q8_0
  case " $(args_of "$v") " in
    *" --quant-aware $(storage_of "$v") "*) carried+=("drafter-$(name_of "$v")-$(storage_of "$v")") ;;
    *) carried+=("drafter-$(name_of "$v")-q8_0") ;;
  esac
done
rm -rf "$run/back" && mkdir -p "$run/back"
(cd "$run" && tar cf - "${shard_dirs[@]#"$run"/}" "${carried[@]}" train-*/log.jsonl score-*/log.jsonl train-*.log \
  $(ls data-*.log 2>/dev/null) | xz -T0 -3 | split -b 15M -d -a 3 - back/run-back.tar.xz.part.) || fail "pack"
ls -l "$run/back"

stage eval
evaluated=$run/drafter-$(name_of "${variants[0]}")
python3 -m eval.math500 --target "$target" --drafter "$evaluated" --data "${MATH500:-eval/data/math500.jsonl.gz}" \
  --concurrency 64 --baseline --output "$run/eval" --no-progress || fail "eval"
python3 -m eval.humaneval --target "$target" --drafter "$evaluated" \
  --concurrency "${HUMANEVAL_CONCURRENCY:-1}" --baseline --output "$run/eval-humaneval" --no-progress || fail "eval humaneval"
stage done

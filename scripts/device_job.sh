# Sourced by the device job scripts (device_trees.sh, device_features.sh) after they
# set `out` and `default_stages`: the cache and report directories, the carried GGUFs unpacked once (one tar
# in pieces in /tmp/xfer, ggufs.tar.part.*), the device recorded, the demo target converted (`target`; the shipped
# drafter's path: `drafter`); `stage`, `wanted`, `gpu_suite` and `eval_batch1`.
# The job runs from a copy of the working tree (its GGUF pieces left out): every device call copies the tree there
# again, and a stage whose Python starts while its files are being replaced can fail to import them
if [ -z "${SPECDEC_JOB_TREE:-}" ]; then
  export SPECDEC_JOB_TREE
  SPECDEC_JOB_TREE=$(mktemp -d /tmp/job-tree.XXXXXX)
  tar cf - --exclude=./.gpu/xfer --exclude=./.git . | tar xf - -C "$SPECDEC_JOB_TREE"
  cd "$SPECDEC_JOB_TREE" && source .gpu/setup.sh && exec bash "$0" "$@"
fi
mkdir -p "$out"
export SPECDEC_CACHE=${SPECDEC_CACHE:-/tmp/specdec-cache} PYTHONUNBUFFERED=1 SPECDEC_REPORT_DIR=$out
target=qwen2.5-coder-1.5b-instruct
drafter=$(pwd)/drafters/checkpoints/qwen2.5-coder-1.5b-dflash-b16  # the shipped drafter
stage() { echo "=== $(date +%T) $1"; }
wanted() { [[ " ${STAGES:-$default_stages} " == *" $1 "* ]]; }
mkdir -p "$SPECDEC_CACHE/gguf"
if ls /tmp/xfer/ggufs.tar.part.* > /dev/null 2>&1 && [ ! -e "$SPECDEC_CACHE/gguf/.unpacked" ]; then
  cat /tmp/xfer/ggufs.tar.part.* | tar xf - -C "$SPECDEC_CACHE/gguf" && touch "$SPECDEC_CACHE/gguf/.unpacked"
fi
# the project's packages the device image lacks, carried as wheels (scripts/pack_device_deps.sh), once per machine
if ls .gpu/deps/*.whl > /dev/null 2>&1 && ! python3 -c "import llguidance, fastapi, math_verify" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/deps/*.whl
fi
# a machine whose first call did not carry .gpu/fi.tar.xz is marked set up without flashinfer: say so before any work
python3 -c "import flashinfer.prefill" 2> /dev/null || {
  echo "flashinfer is missing from /tmp/site: carry .gpu/fi.tar.xz and run tar xJf .gpu/fi.tar.xz -C /tmp/site" >&2
  exit 1
}
# the server's event loop: uvloop, which `pip install specdec` brings with uvicorn[standard]; its wheel is carried
# apart (.gpu/extra) where the device image lacks it
if ls .gpu/extra/*.whl > /dev/null 2>&1 && ! python3 -c "import uvloop" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/extra/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
# the GPU's clocks, power and throttle reasons and the host's load, once a second while the job runs: on H200s whole
# runs were sometimes slower in every step, plain decoding's too (2026-11-26 and 27); a load row's `started` (unix
# time) and wall time find its stretch here
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -l 1 > "$out/gpu-clocks.csv" 2>&1 &
# (the host line: unix time, load averages, the cumulative cpu times of /proc/stat, whose 8th is steal, and the
# cores' mean clock in MHz: slow stretches on 2026-11-27 had full GPU clocks, no throttle reason, lower GPU power and
# a load of 1-3, so the GPU was waiting on a host slowed by something outside the job)
(while sleep 1; do
  echo "$(date +%s) $(cut -d' ' -f1-4 /proc/loadavg) $(head -1 /proc/stat | cut -d' ' -f3-10)" \
    "$(awk '/MHz/ {s += $4; n++} END {if (n) printf "%.0f", s / n}' /proc/cpuinfo)"
done > "$out/host-load.log") &
trap 'kill $(jobs -p) 2> /dev/null' EXIT
# the demo target, converted once, unless the job's stages are among `no_target_stages` only (a job script's list of
# stages that need no target, such as the GPU suite on SmolLM2 and steps of random weights)
needs_target() {
  local s
  for s in ${STAGES:-$default_stages}; do [[ " ${no_target_stages:-} " == *" $s "* ]] || return 0; done
  return 1
}
if needs_target; then
  python3 -c "from specdec.weights.demo_models import resolve_model; print(resolve_model('$target'))" || exit 1
fi
gpu_suite() {  # the whole GPU test suite on the small demo model, log in $out/gpu-all.log
  stage "the whole GPU suite"
  SPECDEC_GPU_MODEL=smollm2-135m-instruct python3 -m pytest -q tests/gpu -rA > "$out/gpu-all.log" 2>&1
  tail -3 "$out/gpu-all.log"
}
eval_batch1() {  # eval_batch1 NAME [ARGS...]: math500 one prompt at a time (`limit` problems, the shipped drafter),
  # pinned to one core, results in $out/math500-b1-NAME; with PROFILE set, under cProfile, its host time per verify
  # step by function in $out/NAME.md
  local name=$1
  shift
  stage "math500, batch 1, $name${PROFILE:+, under cProfile}"
  taskset -c 4 python3 ${PROFILE:+-m cProfile -o "$out/$name.prof"} -m eval.math500 --drafter "$drafter" \
    --limit "$limit" --max-num-seqs 1 --no-progress --output "$out/math500-b1-$name" "$@" 2>&1 \
    | grep -v "Loading weights" | tail -8
  if [ -n "${PROFILE:-}" ]; then
    python3 -m scripts.bench.host_profile "$out/$name.prof" --results "$out/math500-b1-$name/results.json" \
      --top 60 > "$out/$name.md"
  fi
}

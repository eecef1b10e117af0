#!/usr/bin/env bash
# Device side: vLLM's OpenAI-compatible server on 127.0.0.1 from its carried wheels (`bash scripts/peers/install.sh vllm`
# first), the shipped drafter as its DFlash speculator with the settings scripts/bench/peer_worker.py gives it, and
# vLLM's prefix caching on, for `scripts/bench_serve.py --base-url http://127.0.0.1:PORT`.
#   bash scripts/peers/vllm_server.sh MODEL_DIR DRAFTER_DIR PORT [more vLLM server args]
# DRAFTER_DIR in plain bf16 weights (`python scripts/export_drafter.py NAME DIR`): vLLM cannot read the shipped
# drafters' compact storage.
# Returns once /health answers (or fails after 900 s: DFlash's engine build alone takes ~210 s); the server's pid is
# in /tmp/vllm-server.pid, its log in /tmp/vllm-server.log. Stop it with `kill -- -$(cat /tmp/vllm-server.pid)` (its
# process group: vLLM's engine process too).
set -euo pipefail
model=$1 drafter=$2 port=$3
shift 3
seqs=${MAX_NUM_SEQS:-64}
spec="{\"method\": \"dflash\", \"model\": \"$drafter\", \"num_speculative_tokens\": 15}"
# only vLLM's own site on the path (its flashinfer pin differs from ours); from /tmp, away from this checkout's packages
(cd /tmp && PYTHONPATH=/tmp/peers/vllm setsid nohup python3 -m vllm.entrypoints.openai.api_server --model "$model" \
  --host 127.0.0.1 --port "$port" --dtype bfloat16 --seed 0 --max-num-seqs "$seqs" --max-model-len 8192 \
  --max-num-batched-tokens $((seqs * 16 + 2048 > 8192 ? seqs * 16 + 2048 : 8192)) --gpu-memory-utilization 0.85 \
  --generation-config vllm --enable-prefix-caching --speculative-config "$spec" "$@" > /tmp/vllm-server.log 2>&1 &
  echo $! > /tmp/vllm-server.pid)
for _ in $(seq 900); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2> /dev/null \
    && { echo "vLLM server up on port $port"; exit 0; }
  kill -0 "$(cat /tmp/vllm-server.pid)" 2> /dev/null || { tail -20 /tmp/vllm-server.log; exit 1; }
  sleep 1
done
echo "vLLM server not healthy after 900 s"; tail -20 /tmp/vllm-server.log; exit 1

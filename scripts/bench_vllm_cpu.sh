#!/usr/bin/env bash
# pagedserve beside vLLM's CPU build, on the workloads of docs/bench/vllm-cpu/README.md: each workload is one
# `pagedserve bench` invocation that sends the same requests to both servers, one after the other.
#
#   scripts/bench_vllm_cpu.sh [OUT=docs/bench/vllm-cpu] [VLLM=http://127.0.0.1:8000] [PAGEDSERVE=127.0.0.1:50051]
#
# Both servers must be up already, freshly started: `pagedserve up --kv-memory 2GiB --run-dir DIR`, and vLLM
# as that README says. Both keep a prefix cache, so a server that saw these prompts before would skip their
# prefill: each workload has its own seed, and neither server may have run this script since it started.
# Set ENDPOINTS=DIR/endpoints.json to add pagedserve's own counters (KV fragmentation, prefix hits).
set -euo pipefail
out=${1:-docs/bench/vllm-cpu}
vllm=${2:-http://127.0.0.1:8000}
pagedserve=${3:-127.0.0.1:50051}
model=${MODEL:-$HOME/.cache/pagedserve/models/SmolLM2-135M-Instruct}
here=$(cd "$(dirname "$0")/.." && pwd)
bench=("$here/.venv/bin/pagedserve" bench --target "pagedserve=$pagedserve" --target "vllm=$vllm" --model "$model"
  --workload random ${ENDPOINTS:+--endpoints "$ENDPOINTS"})

"${bench[@]}" --requests 32 --concurrency 32 --seed 1 --input-len 64-512 --output-len 16-256 --out "$out/at-once-32"
"${bench[@]}" --requests 24 --rate 0.5 --seed 7 --input-len 64-512 --output-len 16-256 --out "$out/poisson-0.5"
"${bench[@]}" --requests 8 --concurrency 8 --seed 3 --input-len 512 --output-len 1024 --out "$out/512-in-1024-out"

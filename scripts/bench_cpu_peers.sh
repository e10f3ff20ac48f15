#!/usr/bin/env bash
# pagedserve's CPU precisions beside vLLM's CPU build and llama.cpp's server, on the workloads of
# docs/bench/cpu-peers/README.md. Each system runs alone on the machine: the script starts it, sends it the
# three workloads through `pagedserve bench` (the same seeds, so the same requests for every system), and
# stops it before the next one starts. Then scripts/bench_table.py writes the table.
#
#   scripts/bench_cpu_peers.sh [OUT=docs/bench/cpu-peers] [SYSTEM...]
#
# SYSTEM names a server and its configuration: pagedserve-[int8-](bf16|fp32)[-kvbf16][-chunkN][-threadsN] (int8
# weights, the dtype, --kv-cache-dtype bfloat16, --max-batched-tokens N, the worker's --threads N),
# vllm-(bf16|fp32) or llama-q8_0 (default: the list below). The peers are installed beside pagedserve, never
# in its environment: VLLM_PYTHON is the python of vLLM's CPU build, LLAMA_SERVER llama.cpp's llama-server
# and LLAMA_GGUF the model as a Q8_0 GGUF (that README says how each was made).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/docs/bench/cpu-peers}
shift || true
model=${MODEL:-$HOME/.cache/pagedserve/models/SmolLM2-135M-Instruct}
vllm_python=${VLLM_PYTHON:-/work/peers/vllm-venv/bin/python}
llama_server=${LLAMA_SERVER:-/work/peers/llama-server}
llama_gguf=${LLAMA_GGUF:-/work/peers/smollm2-q8_0.gguf}
systems=("$@")
[ ${#systems[@]} -gt 0 ] || systems=(pagedserve-bf16 pagedserve-bf16-chunk2048 pagedserve-int8-bf16 pagedserve-fp32
  vllm-bf16 llama-q8_0)
run_dir=$(mktemp -d)
trap 'stop; rm -rf "$run_dir"' EXIT
server=
target=

stop() {
  if [ -n "$server" ]; then
    kill -INT -- "-$server" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 -- "-$server" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$server" 2>/dev/null || true
    server=
  fi
}

wait_http() {  # until $1 answers, or 15 minutes (vLLM compiles at every start)
  for _ in $(seq 900); do curl -sf "$1" >/dev/null && return 0; sleep 1; done
  echo "$1 never answered" >&2
  return 1
}

start() {  # starts system $1 in its own process group (server) and names it for bench (target)
  local log="$out/$1/server.log"
  mkdir -p "$out/$1"
  case $1 in
    pagedserve-*)
      local flags=(--kv-memory 2GiB --run-dir "$run_dir/$1")
      [[ $1 == *-bf16* ]] && flags+=(--dtype bfloat16)
      [[ $1 == *-fp32* ]] && flags+=(--dtype float32)
      [[ $1 == *-int8-* ]] && flags+=(--quantization int8)
      [[ $1 == *-kvbf16* ]] && flags+=(--kv-cache-dtype bfloat16)
      [[ $1 =~ -chunk([0-9]+) ]] && flags+=(--max-batched-tokens "${BASH_REMATCH[1]}")
      [[ $1 =~ -threads([0-9]+) ]] && flags+=(--threads "${BASH_REMATCH[1]}")
      setsid "$here/.venv/bin/pagedserve" up --model "$model" "${flags[@]}" >"$log" 2>&1 &
      server=$!
      target="$1=127.0.0.1:50051" ;;
    vllm-*)
      local dtype=bfloat16
      [[ $1 == *-fp32 ]] && dtype=float32
      VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$vllm_python" -m \
        vllm.entrypoints.openai.api_server --model "$model" --dtype "$dtype" --max-model-len 2048 --port 8000 \
        >"$log" 2>&1 &
      server=$!
      wait_http http://127.0.0.1:8000/v1/models
      target="$1=http://127.0.0.1:8000" ;;
    llama-*)
      # 16 slots of 2048 tokens; two threads, both for the batch and for a single sequence.
      setsid "$llama_server" -m "$llama_gguf" -a "$model" --port 8001 -c 32768 -np 16 -t 2 -tb 2 >"$log" 2>&1 &
      server=$!
      wait_http http://127.0.0.1:8001/v1/models
      target="$1=http://127.0.0.1:8001" ;;
    *) echo "unknown system $1" >&2; return 1 ;;
  esac
}

for system in "${systems[@]}"; do
  start "$system"
  bench=("$here/.venv/bin/pagedserve" bench --target "$target" --model "$model" --workload random --wait 900)
  "${bench[@]}" --requests 32 --concurrency 32 --seed 1 --input-len 64-512 --output-len 16-256 \
    --out "$out/$system/at-once-32"
  "${bench[@]}" --requests 12 --concurrency 12 --seed 3 --input-len 512 --output-len 256-1024 \
    --out "$out/$system/512-in-1024-out"
  "${bench[@]}" --requests 60 --rate 1 --seed 7 --input-len 64-512 --output-len 16-256 \
    --out "$out/$system/poisson-1"
  stop
done
"$here/.venv/bin/python" "$here/scripts/bench_table.py" "$out" | tee "$out/table.md"

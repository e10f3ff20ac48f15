# Sourced by the bench scripts that run one server at a time: pagedserve's stack in its best CPU
# configuration, or vLLM's CPU build ($VLLM_PYTHON, beside pagedserve, never its dependency), each in a
# process group of its own that `stop` ends. Needs $here (the repository) and $out (the results folder).
# The best configuration depends on the CPU: PAGEDSERVE_PRECISION (default: int8 weights with bfloat16
# activations, for a CPU with AVX512-BF16 or AMX) and VLLM_DTYPE (default bfloat16) override it; on a CPU with
# AVX2 alone, `--dtype float32` and float32.
model=${MODEL:-$HOME/.cache/pagedserve/models/SmolLM2-135M-Instruct}
vllm_python=${VLLM_PYTHON:-/work/peers/vllm-venv/bin/python}
read -ra precision <<<"${PAGEDSERVE_PRECISION:---dtype bfloat16 --quantization int8}"
vllm_dtype=${VLLM_DTYPE:-bfloat16}
run_dir=$(mktemp -d)
server=
trap 'stop; rm -rf "$run_dir"' EXIT

stop() {
  if [ -n "$server" ]; then
    kill -INT -- "-$server" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 -- "-$server" 2>/dev/null || break; sleep 1; done
    server=
  fi
}

start_pagedserve() {  # $1: the system's name; the rest: flags for `pagedserve up`
  local name=$1
  shift
  mkdir -p "$out/$name"
  # --max-batched-tokens 2048 and the precision above: the CPU's best (docs/bench/cpu-peers).
  setsid "$here/.venv/bin/pagedserve" up --model "$model" --run-dir "$run_dir/$name" "${precision[@]}" \
    --max-batched-tokens 2048 --gateway-address 127.0.0.1:50071 "$@" \
    >"$out/$name/server.log" 2>&1 &
  server=$!
}

endpoint() {  # $1: the system's name, $2: a Python expression on endpoints.json's contents, `e`
  python3 -c "import json, sys; e = json.load(open(sys.argv[1])); print($2)" "$run_dir/$1/endpoints.json"
}

start_vllm() {  # $1: the system's name, $2: its KV cache in GB; the rest: flags for vLLM's server
  local name=$1 kv_gb=$2
  shift 2
  mkdir -p "$out/$name"
  VLLM_CPU_KVCACHE_SPACE=$kv_gb VLLM_CPU_NUM_OF_RESERVED_CPU=0 setsid "$vllm_python" -m \
    vllm.entrypoints.openai.api_server --model "$model" --dtype "$vllm_dtype" --max-model-len 8192 --port 8000 \
    "$@" >"$out/$name/server.log" 2>&1 &
  server=$!
  for _ in $(seq 900); do curl -sf http://127.0.0.1:8000/v1/models >/dev/null && break; sleep 1; done
}

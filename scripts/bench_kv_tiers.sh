#!/usr/bin/env bash
# The daemon's disk tier on pagedserve bench's multi-turn workload: the same sessions against a stack with a
# pool far smaller than their working set, with the tier (--kv-disk) and without, and against one whose pool
# holds everything (the in-memory ideal). Each stack runs alone: started, loaded, its daemon's metrics kept,
# stopped. Then scripts/bench_table.py writes the table.
#
#   scripts/bench_kv_tiers.sh OUT [INPUT_LEN [OUTPUT_LEN [SESSIONS]]]   (defaults: 256-512, 32-64, 32)
#
# The stack: int8 weights, bfloat16, --max-batched-tokens 2048 (the CPU's best, docs/bench/cpu-peers); the
# small pool is --kv-memory 512MiB, the large one 4GiB; the tier 8GiB in a fresh folder under OUT.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?OUT}
input_len=${2:-256-512}
output_len=${3:-32-64}
sessions=${4:-32}
model=${MODEL:-$HOME/.cache/pagedserve/models/SmolLM2-135M-Instruct}
run_dir=$(mktemp -d)
server=
trap 'stop; rm -rf "$run_dir" "$out/disk"' EXIT

stop() {
  if [ -n "$server" ]; then
    kill -INT -- "-$server" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 -- "-$server" 2>/dev/null || break; sleep 1; done
    server=
  fi
}

one() {  # $1: the system's name; the rest: flags for `pagedserve up`
  local name=$1
  shift
  mkdir -p "$out/$name"
  setsid "$here/.venv/bin/pagedserve" up --model "$model" --run-dir "$run_dir/$name" --dtype bfloat16 \
    --quantization int8 --max-batched-tokens 2048 --gateway-address 127.0.0.1:50071 "$@" \
    >"$out/$name/server.log" 2>&1 &
  server=$!
  "$here/.venv/bin/pagedserve" bench --target "$name=127.0.0.1:50051" --model "$model" --wait 300 \
    --workload multi-turn --requests "$sessions" --turns 6 --concurrency 4 --seed 11 \
    --input-len "$input_len" --output-len "$output_len" --endpoints "$run_dir/$name/endpoints.json" \
    --out "$out/$name/multi-turn"
  local metrics
  metrics=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["daemon"]["metrics"])' \
    "$run_dir/$name/endpoints.json")
  curl -sf "$metrics" | grep '^pagedserve_kv_' >"$out/$name/daemon-metrics.txt"
  stop
}

one tier --kv-memory 512MiB --kv-disk "$out/disk" --kv-disk-size 8GiB
one no-tier --kv-memory 512MiB
one in-memory --kv-memory 4GiB
"$here/.venv/bin/python" - "$out" <<'TABLE' | tee "$out/table.md"
import json, sys
from pathlib import Path

folder = Path(sys.argv[1])
print("| system | prefix hits | of the ideal | TTFT p50 | TTFT p99 | out tok/s | TPOT p50 |")
print("|---|---|---|---|---|---|---|")
for name in ("tier", "no-tier", "in-memory"):
    result = json.loads((folder / name / "multi-turn" / "bench.json").read_text())
    (run,) = result["runs"]
    (ideal,) = result["config"]["ideal_prefix_hit_rate"].values()
    s = run["summary"]
    hits = s["cached_prompt_tokens"] / s["prompt_tokens"]
    ttft, tpot = s["ttft_s"], s["tpot_s"]
    print(f"| {name} | {hits:.1%} | {hits / ideal:.0%} | {ttft['p50']:.2f} s | {ttft['p99']:.2f} s | "
          f"{s['output_tokens_per_s']:.1f} | {tpot['p50'] * 1e3:.0f} ms |")
TABLE

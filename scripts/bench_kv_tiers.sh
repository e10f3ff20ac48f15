#!/usr/bin/env bash
# The daemon's tiers on pagedserve bench's multi-turn workload: the same sessions against a stack with a
# pool far smaller than their working set, with the disk tier (--kv-disk), with the host-memory tier
# (--kv-host-memory) and without either, against one whose pool
# holds everything (the in-memory ideal), and against vLLM's CPU build with prefix caching (in bfloat16, its
# KV cache at the 1 GB it takes at least; $VLLM_PYTHON, beside pagedserve, never its dependency). Each
# server runs alone: started, loaded, its metrics kept, stopped. Then the table.
#
#   scripts/bench_kv_tiers.sh OUT [INPUT_LEN [OUTPUT_LEN [SESSIONS]]]   (defaults: 256-512, 32-64, 32)
#
# SYSTEMS picks some of them (default: "tier host-tier no-tier in-memory vllm"), in one run.
# The stack: int8 weights, bfloat16, --max-batched-tokens 2048 (the CPU's best, docs/bench/cpu-peers); the
# small pool is --kv-memory 512MiB, the large one 4GiB; the disk tier 8GiB in a fresh folder under OUT, the
# host-memory tier 8GiB.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?OUT}
input_len=${2:-256-512}
output_len=${3:-32-64}
sessions=${4:-32}
systems=${SYSTEMS:-tier host-tier no-tier in-memory vllm}
# shellcheck source=scripts/bench_servers.sh
source "$here/scripts/bench_servers.sh"
trap 'stop; rm -rf "$run_dir" "$out/disk"' EXIT

sessions_bench() {  # $1: the system's name, $2: its address; the rest: flags for bench
  local name=$1 address=$2
  shift 2
  "$here/.venv/bin/pagedserve" bench --target "$name=$address" --model "$model" --wait 900 \
    --workload multi-turn --requests "$sessions" --turns 6 --concurrency 4 --seed 11 \
    --input-len "$input_len" --output-len "$output_len" --out "$out/$name/multi-turn" "$@"
}

one() {  # $1: the system's name; the rest: flags for `pagedserve up`
  local name=$1
  start_pagedserve "$@"
  sessions_bench "$name" 127.0.0.1:50051 --endpoints "$run_dir/$name/endpoints.json"
  curl -sf "$(endpoint "$name" 'e["daemon"]["metrics"]')" | grep '^pagedserve_kv_' >"$out/$name/daemon-metrics.txt"
  stop
}

for system in $systems; do
  case $system in
    tier) one tier --kv-memory 512MiB --kv-disk "$out/disk" --kv-disk-size 8GiB ;;
    host-tier) one host-tier --kv-memory 512MiB --kv-host-memory 8GiB ;;
    no-tier) one no-tier --kv-memory 512MiB ;;
    in-memory) one in-memory --kv-memory 4GiB ;;
    vllm)
      start_vllm vllm 1 --enable-prefix-caching --enable-prompt-tokens-details
      sessions_bench vllm http://127.0.0.1:8000
      stop
      ;;
    *) echo "no system $system: SYSTEMS takes tier, host-tier, no-tier, in-memory and vllm" >&2; exit 2 ;;
  esac
done
"$here/.venv/bin/python" - "$out" "$systems" <<'TABLE' | tee "$out/table.md"
import json, sys
from pathlib import Path

folder = Path(sys.argv[1])
print("| system | prefix hits | of the ideal | TTFT p50 | TTFT p99 | out tok/s | TPOT p50 |")
print("|---|---|---|---|---|---|---|")
for name in sys.argv[2].split():
    result = json.loads((folder / name / "multi-turn" / "bench.json").read_text())
    (run,) = result["runs"]
    (ideal,) = result["config"]["ideal_prefix_hit_rate"].values()
    s = run["summary"]
    hits = s["cached_prompt_tokens"] / s["prompt_tokens"]
    ttft, tpot = s["ttft_s"], s["tpot_s"]
    print(f"| {name} | {hits:.1%} | {hits / ideal:.0%} | {ttft['p50']:.2f} s | {ttft['p99']:.2f} s | "
          f"{s['output_tokens_per_s']:.1f} | {tpot['p50'] * 1e3:.0f} ms |")
TABLE

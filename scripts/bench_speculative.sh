#!/usr/bin/env bash
# Speculative decoding on pagedserve bench's copy and chat workloads (real text through the chat template,
# greedy), at concurrency 1, 4 and 16: a stack with --speculative off, one with --speculative ngram, one with
# --speculative draft, and vLLM's CPU build with its n-gram speculation ($VLLM_PYTHON, beside pagedserve,
# never its dependency), each with 4 speculative tokens and n-grams of 2 to 4. The draft model is the default
# model itself: no smaller model of its tokenizer is at hand here, so this measures the draft model's cost
# with (greedy) every draft kept. Each server runs alone: started, loaded, stopped. Then the table and the
# ratios against speculation off.
#
#   scripts/bench_speculative.sh OUT [REQUESTS [SYSTEMS]]
#
# The default: 16 requests a run, and the systems off ngram draft vllm-ngram.
#
# SYSTEMS reruns some systems into OUT, and the table is made again from all four. vLLM runs with Intel's
# OpenMP preloaded where its build ships it, as its warning at start asks for speculative decoding on a CPU.
#
# Every system runs in bfloat16 (vLLM's CPU build runs nothing else well); pagedserve with int8 weights and
# --max-batched-tokens 2048, its best CPU configuration (docs/bench/cpu-peers).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:?OUT}
requests=${2:-16}
systems=${3:-off ngram draft vllm-ngram}
# shellcheck source=scripts/bench_servers.sh
source "$here/scripts/bench_servers.sh"

workloads() {  # $1: the system's name, $2: its address; the rest: flags for bench
  local name=$1 address=$2
  shift 2
  for workload in copy chat; do
    "$here/.venv/bin/pagedserve" bench --target "$name=$address" --model "$model" --wait 900 \
      --workload "$workload" --requests "$requests" --concurrency 1,4,16 --seed 5 \
      --out "$out/$name/$workload" "$@"
  done
}

one() {  # $1: the system's name; the rest: flags for `pagedserve up`
  local name=$1
  start_pagedserve "$@"
  workloads "$name" 127.0.0.1:50051 --endpoints "$run_dir/$name/endpoints.json"
  curl -sf "$(endpoint "$name" 'e["workers"][0]["metrics"]')" \
    | grep -E '^pagedserve_worker_(spec|engine_steps|generation)' >"$out/$name/worker-metrics.txt"
  stop
}

for system in $systems; do
  case $system in
    off) one off --speculative off ;;
    ngram) one ngram --speculative ngram --num-speculative-tokens 4 ;;
    draft) one draft --speculative draft --draft-model "$model" --num-speculative-tokens 4 ;;
    vllm-ngram)
      iomp=$(dirname "$vllm_python")/../lib/libiomp5.so
      LD_PRELOAD=$([ -f "$iomp" ] && echo "$iomp" || true) start_vllm vllm-ngram 2 --speculative-config \
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
      workloads vllm-ngram http://127.0.0.1:8000
      stop
      ;;
  esac
done
"$here/.venv/bin/python" - "$out" <<'TABLE' | tee "$out/table.md"
import json, sys
from pathlib import Path

folder = Path(sys.argv[1])
systems = ("off", "ngram", "draft", "vllm-ngram")
print("| workload | concurrency | system | TPOT p50 | out tok/s | vs off: TPOT p50 | vs off: tok/s |")
print("|---|---|---|---|---|---|---|")
for workload in ("copy", "chat"):
    runs = {
        (name, run["load"]): run["summary"]
        for name in systems
        for run in json.loads((folder / name / workload / "bench.json").read_text())["runs"]
    }
    for load in (1, 4, 16):
        base = runs[("off", load)]
        for name in systems:
            s = runs[(name, load)]
            tpot, rate = s["tpot_s"]["p50"], s["output_tokens_per_s"]
            print(f"| {workload} | {load} | {name} | {tpot * 1000:.1f} ms | {rate:.1f} "
                  f"| {tpot / base['tpot_s']['p50']:.2f}x | {rate / base['output_tokens_per_s']:.2f}x |")
TABLE

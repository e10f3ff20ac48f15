#!/usr/bin/env bash
# One command for a lent GPU machine (torch, CuPy, transformers and grpcio there; no internet):
#   1. the CUDA kernels against the torch reference, CUDA IPC between processes, and greedy parity with
#      transformers through `pagedserve up --device cuda` (the test_cuda_* files of tests/kernels, tests/gpu);
#   2. each kernel's time against the bytes it moves and a device copy, paged decode against torch-native
#      paged attention, and end-to-end tokens/s (scripts/bench_kernels.py);
#   3. where a decode step's time goes, phase by phase, steps one by one and with async scheduling
#      (scripts/bench_step.py);
#   4. with GPU_CHECK_E2E=1 only (several minutes more): an 8B-shaped Llama through `pagedserve up` against
#      transformers' generate, and batch 1's inter-token latency against the weight-read floor
#      (scripts/bench_e2e.py).
# It runs from the source tree with no install step. Python packages the machine lacks travel as wheels in
# .whl/ (scripts/gpu_wheels.sh fetches them here; name .whl in the run's carry). Logs go to $OUT.
# Budget: under 10 minutes. The short table comes last.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PAGEDSERVE_CACHE=/tmp/pagedserve-cache

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, cupy, grpc, google.protobuf as pb; print('torch', torch.__version__, 'cupy', cupy.__version__, 'grpcio', grpc.__version__, 'protobuf', pb.__version__)" | tee -a "$OUT/gpu.txt"

# The CUDA kernels' tests only: CI compiles every variant and runs the CPU kernels' tests already.
timeout 330 $PY -m pytest -q -p no:cacheprovider -o addopts= tests/kernels/test_cuda_kernels.py \
    tests/kernels/test_cuda_rowwise.py tests/kernels/test_cuda_graphs.py tests/gpu 2>&1 | tee "$OUT/tests.log"
tests_status=${PIPESTATUS[0]}
timeout 240 $PY scripts/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
bench_status=${PIPESTATUS[0]}
timeout 120 $PY scripts/bench_step.py 2>&1 | tee "$OUT/step.log"
step_status=${PIPESTATUS[0]}
e2e_status=0
if [ -n "${GPU_CHECK_E2E:-}" ]; then  # minutes of its own: an 8B-shaped model made, loaded twice
    timeout 600 $PY scripts/bench_e2e.py 2>&1 | tee "$OUT/e2e.log"
    e2e_status=${PIPESTATUS[0]}
fi

echo
echo "== gpu_check: $(head -1 "$OUT/gpu.txt")"
echo "tests: $(tail -1 "$OUT/tests.log") (exit $tests_status)"
sed -n '/device copy/,$p' "$OUT/bench.log"
echo "bench exit $bench_status"
echo "decode step (scripts/bench_step.py):"
sed -n '/decodes a step/,$p' "$OUT/step.log"
echo "step exit $step_status"
if [ -n "${GPU_CHECK_E2E:-}" ]; then
    sed -n '/GB of weights/,$p' "$OUT/e2e.log"
    echo "e2e exit $e2e_status"
fi
[ "$tests_status" = 0 ] && [ "$bench_status" = 0 ] && [ "$step_status" = 0 ] && [ "$e2e_status" = 0 ]

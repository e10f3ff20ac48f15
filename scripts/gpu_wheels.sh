#!/usr/bin/env bash
# Fetch, here, the wheels that the lent GPU machine (Python 3.12, no internet) lacks or has too old for the
# generated stubs, into .whl/ (git-ignored), to carry with scripts/gpu_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 smg-grpc-proto==0.4.28
ls -la .whl

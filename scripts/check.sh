#!/usr/bin/env bash
# The checks CI runs before the tests: lint, format, types, and the import layers.
#   bash scripts/check.sh            (with the venv of the README's test command in .venv/)
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${VENV:-.venv}/bin
run() { echo "+ $*"; "$@"; }
run "$bin/ruff" check .
run "$bin/ruff" format --check .
run "$bin/mypy"  # the packages and settings are in pyproject.toml; the stubs' .pyi files are checked against
run "$bin/lint-imports"  # the contracts in pyproject.toml: imports only point down

#!/usr/bin/env bash
# Set up (or reuse) .venv, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check engine proxy operator cli bench serving tests benchmarks
.venv/bin/python scripts/typecheck.py
.venv/bin/python -P -m pytest "$@"

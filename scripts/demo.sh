#!/usr/bin/env bash
# Set up (or reuse) .venv, then run the local demo: engine + proxy on the bundled model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/decodectl demo "$@"

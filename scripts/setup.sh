#!/usr/bin/env bash
# Create or reuse .venv at the repo root, install DecodeService with its test extras on the CPU torch
# wheel, and pull the bundled model. Safe to run again: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.decodeservice-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # The CPU wheel; a looser pin pulls a multi-GB CUDA build. GPU users: see README "GPU".
    .venv/bin/python -P -m pip install --quiet "torch==${DECODESERVICE_TORCH_VERSION:-2.13.0}"
    .venv/bin/python -P -m pip install --quiet -e ".[test]"
    echo "$want" > "$stamp"
fi
.venv/bin/decodectl models pull smollm2-135m
# Prometheus and promtool (Debian's `prometheus` package): tests/monitoring starts its own Prometheus on
# 127.0.0.1 and runs `promtool test rules`; without them those tests skip, except on CI, where they fail.
# The package's own service is not started (policy-rc.d refuses it), so nothing lingers.
if ! command -v promtool >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod +x "$policy"
        made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if [ "$made_policy" -eq 1 ]; then rm -f "$policy"; fi
fi

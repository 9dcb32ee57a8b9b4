"""The Prometheus binaries the monitoring tests run (Debian's `prometheus` package, scripts/setup.sh).

Where one is missing the test is skipped with the reason, except on CI (`CI=true`), where it fails: CI's
set-up installs them, so a missing binary there is a broken set-up, not an optional extra.
"""

from __future__ import annotations

import os
import shutil

import pytest


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed (Debian: apt-get install prometheus; scripts/setup.sh does it as root)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason}, and CI must run this test")
        pytest.skip(reason)
    return path

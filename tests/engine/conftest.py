"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from types import ModuleType

import pytest

from decodeservice.engine.attention import native_decode


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    """The native paged-decode attention kernel (engine/attention/paged_decode.cpp), built or loaded once per
    module; the test is skipped where it did not build (no AVX2 or no compiler: the torch paths run)."""
    module = native_decode.decode_extension()
    if module is None:
        pytest.skip("the native attention kernel did not build here (no AVX2, or no compiler): the torch paths run")
    return module

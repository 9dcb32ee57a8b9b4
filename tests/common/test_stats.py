"""The project's one percentile rule agrees with numpy's default and with statistics.median."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodeservice.common.stats import percentile


def test_interpolates_between_ranks() -> None:
    values = [3.0, 1.0, 2.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([5.0], 1) == 5.0


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_matches_numpy_and_the_median(values: list[float], p: float) -> None:
    assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-9, abs=1e-6)
    assert percentile(values, 50) == pytest.approx(statistics.median(values), rel=1e-9, abs=1e-6)


@pytest.mark.parametrize(("values", "p"), [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_refuses_no_values_and_out_of_range(values: list[float], p: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, p)

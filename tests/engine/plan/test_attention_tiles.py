"""engine/plan/attention_tiles.py: the native attention kernel's tile height, timed at start-up on the
model's shape, kept per machine in the kernel cache, and chosen over the default only by a clear margin."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from decodeservice.engine.attention import native_decode
from decodeservice.engine.plan import attention_tiles
from decodeservice.engine.plan.execution import MEASURED_NOW


@pytest.mark.parametrize("kv_int8_rows", [False, True], ids=["activation_rows", "int8_rows"])
def test_every_height_is_timed_and_the_choice_is_kept_for_the_next_start(kernel: ModuleType, tmp_path: Path,
                                                                         kv_int8_rows: bool) -> None:
    first = attention_tiles.choose_tile_rows(kernel, heads=6, kv_heads=2, head_dim=64, activations=torch.float32,
                                             kv_int8_rows=kv_int8_rows, rounds=1, cache_dir=tmp_path)
    assert first.source == MEASURED_NOW
    assert set(first.timings_us) == set(attention_tiles.CANDIDATES) and all(us > 0 for us in first.timings_us.values())
    assert first.rows in attention_tiles.CANDIDATES
    again = attention_tiles.choose_tile_rows(kernel, heads=6, kv_heads=2, head_dim=64, activations=torch.float32,
                                             kv_int8_rows=kv_int8_rows, rounds=1, cache_dir=tmp_path)
    assert (again.rows, again.timings_us) == (first.rows, first.timings_us)
    assert again.source != MEASURED_NOW and Path(again.source).parent == tmp_path


@pytest.mark.parametrize(("timings", "chosen"), [
    ({1: 300.0, 2: 200.0, 4: 97.0, 8: 120.0, 16: 100.0}, 16),  # 3 % faster: inside a start-up timing's noise
    ({1: 300.0, 2: 200.0, 4: 80.0, 8: 90.0, 16: 100.0}, 4),
    ({1: 90.0, 2: 95.0, 4: 99.0, 8: 99.0, 16: 100.0}, 1),
])
def test_another_height_replaces_the_default_only_by_a_clear_margin(kernel: ModuleType, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    timings: dict[int, float], chosen: int) -> None:
    monkeypatch.setattr(attention_tiles, "time_heights", lambda *args, **kwargs: timings)
    choice = attention_tiles.choose_tile_rows(kernel, heads=6, kv_heads=2, head_dim=64, activations=torch.float32,
                                              kv_int8_rows=False, cache_dir=tmp_path)
    assert native_decode.TILE_ROWS == 16 and choice.rows == chosen


def test_a_torn_cache_file_is_measured_again(kernel: ModuleType, tmp_path: Path) -> None:
    choice = attention_tiles.choose_tile_rows(kernel, heads=6, kv_heads=2, head_dim=64, activations=torch.float32,
                                              kv_int8_rows=False, rounds=1, cache_dir=tmp_path)
    (cached,) = tmp_path.glob("tiles-*.json")
    cached.write_text(json.dumps({"rows": 3, "timings_us": {"3": 1.0}}))  # a height that is no candidate
    again = attention_tiles.choose_tile_rows(kernel, heads=6, kv_heads=2, head_dim=64, activations=torch.float32,
                                             kv_int8_rows=False, rounds=1, cache_dir=tmp_path)
    assert again.source == MEASURED_NOW and again.rows in attention_tiles.CANDIDATES
    assert choice.rows in attention_tiles.CANDIDATES

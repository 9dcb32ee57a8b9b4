"""engine/cpp_extensions.py: a header the source includes is part of the build's cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from decodeservice.engine import cpp_extensions

SOURCE = """#include <torch/extension.h>
#include "answer.h"
int64_t answer() { return kAnswer; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def test_a_changed_header_builds_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "answer.cpp", tmp_path / "answer.h"
    source.write_text(SOURCE)
    answers = []
    for value in (41, 42):
        header.write_text(f"constexpr int64_t kAnswer = {value};\n")
        module = cpp_extensions.build_extension(source, what="a test", check=lambda _: True, headers=[header])
        assert module is not None
        answers.append(module.answer())
    assert answers == [41, 42]  # the cache key without the header would load the first build again

"""engine/cpp_extensions.py: a header the source includes is part of the build's cache key; a build killed midway
blocks no later one."""

from __future__ import annotations

import threading
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


def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DECODESERVICE_KERNEL_CACHE", str(tmp_path / "cache"))
    source, header = tmp_path / "answer.cpp", tmp_path / "answer.h"
    source.write_text(SOURCE)
    header.write_text("constexpr int64_t kAnswer = 7;\n")
    assert cpp_extensions.build_extension(source, what="a test", check=lambda _: True, headers=[header])
    for build in cpp_extensions.extension_dir().iterdir():
        (build / "lock").touch()  # what torch's guard leaves when its process dies mid-build
    answers: list[int] = []
    worker = threading.Thread(target=lambda: answers.append(cpp_extensions.build_extension(
        source, what="a test", check=lambda _: True, headers=[header]).answer()), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert answers == [7]  # torch alone waits on that file forever

"""The size-limited body reader both servers use: 413 from the header or while counting, 400 on disconnect."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.types import Message

from decodeservice.common.body import read_body
from decodeservice.common.errors import BadRequest, PayloadTooLarge


class Upload:
    """An ASGI `receive` that hands out the given messages in order and counts the reads."""

    def __init__(self, messages: list[Message]) -> None:
        self._messages: Iterator[Message] = iter(messages)
        self.reads = 0

    async def __call__(self) -> Message:
        self.reads += 1
        return next(self._messages)


def chunks(*parts: bytes) -> list[Message]:
    return [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]


async def test_reads_a_chunked_body_whole() -> None:
    upload = Upload(chunks(b"ab", b"", b"cd"))
    assert await read_body(upload, limit=4, content_length=None) == b"abcd"


async def test_declared_length_over_the_limit_is_413_before_reading() -> None:
    upload = Upload(chunks(b"x"))
    with pytest.raises(PayloadTooLarge) as info:
        await read_body(upload, limit=4, content_length="5")
    assert upload.reads == 0 and info.value.status_code == 413 and info.value.code == "request_too_large"


async def test_counted_bytes_over_the_limit_stop_the_read() -> None:
    upload = Upload(chunks(b"abc", b"de", b"never read"))
    with pytest.raises(PayloadTooLarge):
        await read_body(upload, limit=4, content_length=None)  # a lying or absent header does not help
    assert upload.reads == 2


async def test_disconnect_mid_body_is_a_400_nobody_reads() -> None:
    upload = Upload([{"type": "http.request", "body": b"a", "more_body": True}, {"type": "http.disconnect"}])
    with pytest.raises(BadRequest) as info:
        await read_body(upload, limit=100, content_length=None)
    assert info.value.reason == "disconnected"

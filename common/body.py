"""Reading a request body with a size limit, for both servers (413 before the limit is exceeded).

The declared Content-Length is checked first, so an oversized upload is not even read; a chunked body
has none, so the bytes are counted as they arrive and reading stops at the first byte over the limit.
"""

from __future__ import annotations

from starlette.types import Receive

from decodeservice.common.errors import BadRequest, PayloadTooLarge


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit} bytes", reason="body_too_large")


async def read_body(receive: Receive, *, limit: int, content_length: str | None) -> bytes:
    """The whole body from ASGI `receive`; `content_length` is the header's value, if any."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            # Nobody is left to answer; what is sent back goes nowhere, but nothing else runs.
            raise BadRequest("client disconnected while sending the body", reason="disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)

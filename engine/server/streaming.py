"""Server-sent events that always end the generation when the client goes away.

Starlette's StreamingResponse cancels its body on disconnect but never closes the iterator, so a
generator suspended at `yield` keeps its engine request alive until garbage collection. Here the
iterator is always `aclose()`d, which runs the generation's `finally` and aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_SLOT = "\x00slot\x00"  # JSON escapes control characters, so its encoding cannot occur by chance
_SLOT_JSON = json.dumps(_SLOT).encode()


def text_event_encoder(make: Callable[[str], dict[str, Any]]) -> Callable[[str], bytes]:
    """`text -> sse(make(text))` with everything but the text serialized once: a stream's chunks differ
    only in their text, and each token would otherwise rebuild and encode the whole envelope."""
    head, slot, tail = sse(make(_SLOT)).partition(_SLOT_JSON)
    if not slot or _SLOT_JSON in tail:
        return lambda text: sse(make(text))
    dumps = json.JSONEncoder(ensure_ascii=False).encode
    return lambda text: head + dumps(text).encode() + tail


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self._events.aclose()
        if not stream.cancelled() and (exc := stream.exception()) is not None and not isinstance(exc, OSError):
            raise exc  # a bug in the body, not a client that left

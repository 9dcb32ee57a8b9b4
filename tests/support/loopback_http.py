"""An aiohttp application served on 127.0.0.1 at a free port, for tests that need a real HTTP peer."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serve(app: web.Application, *, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[str]:
    """Yield the base URL (http:// or, with `ssl_context`, https://) while `app` is served."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
    finally:
        await runner.cleanup()

"""Server-sent events: framing and idle keepalives.

Each event is one ``data: <json>`` line and a blank line; the stream ends with
``data: [DONE]``. While a stream is idle for :data:`KEEPALIVE_INTERVAL`
seconds, :func:`with_keepalive` inserts an SSE comment (a line starting with
``:``), which compliant parsers ignore.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, AsyncIterator

KEEPALIVE_INTERVAL = 15.0
DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def data_event(payload: Any) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def comment(text: str = "") -> bytes:
    """An SSE comment line; ``text`` must not contain a newline."""
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment is a single line")
    return f": {text}\n\n".encode() if text else b":\n\n"


async def with_keepalive(
    events: AsyncIterator[bytes], keepalive: bytes, interval: float = KEEPALIVE_INTERVAL
) -> AsyncIterator[bytes]:
    """Yield ``events``, plus ``keepalive`` whenever none came for ``interval`` s.

    The pending ``__anext__`` is never cancelled by a keepalive (cancelling it
    would tear down the source); it is only cancelled when this generator is
    closed, which closes the source as well.
    """
    source = aiter(events)
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield keepalive
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        closer = getattr(source, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()

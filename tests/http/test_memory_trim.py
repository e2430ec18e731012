"""The front gives freed memory back after large bodies (musegl_core/http/memory.py):
only after a body of at least TRIM_AFTER_BYTES, coalesced and bounded (at most one trim
an interval however many requests end, and the last one a whole quiet interval after
the last request), and never failing a request."""

from __future__ import annotations

import asyncio
import sys

import pytest

from musegl_core.http import memory
from musegl_core.http.memory import MemoryTrim
from musegl_core.http.request_log import RequestLog


def counting_trim():
    calls = []
    return calls, lambda: calls.append(1)


def test_small_bodies_never_trim_and_a_burst_of_large_ones_trims_three_times():
    async def main():
        calls, fake = counting_trim()
        trim = MemoryTrim(fake, interval=0.3, min_bytes=1000)
        for _ in range(50):
            trim.after_request(999)
        await asyncio.sleep(0.02)
        assert calls == []
        for _ in range(200):  # all while the first trim runs or waits: one more after it, then
            trim.after_request(1000)  # one after a whole interval without requests
            await asyncio.sleep(0)
        await trim.idle()
        assert len(calls) == 3 and trim.runs == 3
        trim.after_request(5000)  # later, alone: one at once, one an interval later
        await asyncio.sleep(0.02)
        assert len(calls) == 4
        await trim.idle()
        assert len(calls) == 5

    asyncio.run(main())


def test_a_failing_trim_is_swallowed():
    def broken():
        raise OSError("nope")

    async def main():
        trim = MemoryTrim(broken, interval=0)
        trim.request()
        await trim.idle()
        assert trim.runs == 0

    asyncio.run(main())


def test_request_log_counts_the_body_read_and_trims_after_a_large_one():
    async def app(scope, receive, send):
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(handler, chunks):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return messages.pop(0)

        async def send(_):
            pass

        await handler({"type": "http", "method": "POST", "path": "/tokenize", "headers": []}, receive, send)

    async def main():
        calls, fake = counting_trim()
        trim = MemoryTrim(fake, interval=0)
        handler = RequestLog(app, trim=trim)
        await call(handler, [b"x" * 1000])
        await trim.idle()
        assert calls == []
        await call(handler, [b"x" * (memory.TRIM_AFTER_BYTES // 2)] * 2)  # counted across chunks
        await trim.idle()
        assert calls == [1, 1]  # at once, and after a quiet interval

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_the_c_library_trim_runs_where_it_exists():
    trim = MemoryTrim(interval=0)
    if not trim.available:
        pytest.skip("no malloc_trim in this C library (musl)")

    async def main():
        trim.request()
        await trim.idle()
        assert trim.runs == 2

    asyncio.run(main())


@pytest.mark.parametrize("where", ["structure_request", "structure_body"])
def test_a_refused_body_is_freed_without_a_garbage_collection(where):
    """A body that fails type checking leaves no reference cycle behind (the structuring
    failure's tracebacks, the raised error's frame): a body refused with a 400 (10 MiB, say) is freed at
    once, not when the collector next runs."""
    import gc
    import weakref

    from musegl_core.errors import ApiError
    from musegl_core.openai import schemas

    class Body(dict):  # (a dict that takes a weak reference)
        pass

    gc.disable()
    try:
        body = Body(model="m", messages=[Body(role="user", content=5)], max_tokens="x", stop=[1, "a"])
        alive = weakref.ref(body)
        try:
            if where == "structure_request":
                schemas.structure_request(body)
            else:
                schemas.structure_body(body, schemas.ChatCompletionRequest)
        except ApiError as error:
            assert error.param in ("max_tokens", "messages[0].content", "stop[0]")
        del body
        assert alive() is None
    finally:
        gc.enable()

"""Request ids and one summary line per HTTP request.

:class:`RequestLog` wraps the whole application (unmatched paths and errors
included), so that every response carries an ``X-Request-Id`` header:

* an incoming ``X-Request-Id`` is kept when it is sane (1-128 characters of
  ``A-Z a-z 0-9 . _ : - / + = @``), so a proxy's or client's id follows the
  request; otherwise (absent, too long, other characters) a fresh id is made
  (32 hex digits);
* when the response has gone out, one line is logged (logger
  ``musegl.http``)::

      request 5f0c... POST /v1/chat/completions 200 prompt=100 cached=0 completion=16 queue=0.000s ttft=0.084s total=0.262s

  Generation routes add the token counts, the worker's queue time and the
  time to the first token (a request with ``n`` choices: the prompt once,
  the completions summed, the first choice's first token). ``/health`` and
  ``/metrics`` are polled by load balancers and scrapers: their lines are
  DEBUG; every other line is INFO.

The line tells how the request ended, not only the status its headers
carried: a response whose body the client did not wait for (a stream it
closed mid-answer) is logged ``499``, and a stream that ended with an error
event is logged with ``error=<code or type>`` after its status (the surfaces
call :func:`stream_failed`). The completion count includes what was
generated before either happened.

An exception that is not an ``Exception`` (a Rust panic in a native library
reaches Python as a ``BaseException``) passes every handler of Litestar's; here
it becomes a JSON 500 with the request id rather than uvicorn's plain text.

When given a :class:`~musegl_core.http.memory.MemoryTrim`, it also counts
the body bytes the application read and, once a request with a large body
has ended, asks for the front's freed memory to be given back to the system.

The generation code reaches the current request's :class:`RequestRecord`
through :data:`CURRENT` (a context variable), which the front's event
observer (:mod:`musegl_core.http.metrics`) fills in.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import time
import uuid
from typing import Any

import attrs

from musegl_core.http.memory import MemoryTrim

log = logging.getLogger("musegl.http")

HEADER = b"x-request-id"
SANE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
#: paths polled by machines: their summary lines are DEBUG
POLLED = frozenset({"/health", "/v1/health", "/metrics"})
#: the status logged and counted for a request whose client hung up before its body arrived (nginx's 499)
CLIENT_CLOSED = 499
#: ``scope["state"]`` key set once the client disconnected while the application read the body
CLIENT_GONE = "musegl_client_gone"


@attrs.define
class RequestRecord:
    """What one HTTP request did, for its summary line."""

    id: str
    started: float  # time.monotonic() on arrival
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    queue_seconds: float | None = None
    ttft: float | None = None
    error: str | None = None  # a stream's error event: its code, else its type
    prefix_miss: Any = None  # why the prompt reused less than the server held (engine/prefix_miss.py)
    body_bytes: int = 0  # the body bytes read so far (http/offload.py picks a lane by them)

    def started_generating(self, prompt_tokens: int, cached_tokens: int, queue_seconds: float) -> None:
        if self.prompt_tokens is None:  # the first choice's (all share the prompt)
            self.prompt_tokens, self.cached_tokens, self.queue_seconds = prompt_tokens, cached_tokens, queue_seconds

    def first_token(self, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.started

    def finished(self, completion_tokens: int) -> None:
        self.completion_tokens += completion_tokens


CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("musegl_request", default=None)


#: the response header that explains a prefix miss (docs/sessions.md, "Why a prefix missed")
MISS_HEADER = b"x-prefix-cache-miss"


def miss_header(miss: Any) -> bytes:
    """The header's value: the miss as one line of ASCII JSON (the text on each side escaped)."""
    return json.dumps(attrs.asdict(miss), ensure_ascii=True, separators=(",", ":")).encode("ascii")


def stream_failed(error: Any) -> None:
    """A streamed response is ending with an error event (an :class:`~musegl_core.errors.ApiError`):
    its summary line names it."""
    record = CURRENT.get()
    if record is not None and record.error is None:
        record.error = getattr(error, "code", None) or getattr(error, "type", None) or "error"


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The incoming ``X-Request-Id`` when sane, else a fresh one."""
    for name, value in headers:
        if name.lower() == HEADER:
            text = value.decode("latin-1")
            if SANE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


def _printable(text: str, limit: int = 200) -> str:
    """A path as it may appear in a log line: no control characters, bounded."""
    text = text[:limit]
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def summary(record: RequestRecord, method: str, route: str, status: int, now: float) -> str:
    parts = [f"request {record.id} {method} {_printable(route)} {status}"]
    if record.error is not None:
        parts.append(f"error={_printable(record.error, 64)}")
    if record.prompt_tokens is not None:
        parts.append(f"prompt={record.prompt_tokens} cached={record.cached_tokens} "
                     f"completion={record.completion_tokens} queue={record.queue_seconds:.3f}s")
        if record.ttft is not None:
            parts.append(f"ttft={record.ttft:.3f}s")
    if record.prefix_miss is not None:
        parts.append(f"prefix_miss={record.prefix_miss.cause}@{record.prefix_miss.position}")
    parts.append(f"total={now - record.started:.3f}s")
    return " ".join(parts)


class RequestLog:
    """ASGI middleware around the application: the request id and the summary line."""

    def __init__(self, app: Any, trim: MemoryTrim | None = None):
        self.app = app
        self.trim = trim

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id(scope.get("headers") or []), time.monotonic())
        scope.setdefault("state", {})["request_id"] = record.id
        status = 500  # nothing sent: the server's own failure
        started = ended = False

        async def send_with_id(message: Any) -> None:
            nonlocal status, started, ended
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                headers = [(k, v) for k, v in message.get("headers") or [] if k.lower() != HEADER]
                headers.append((HEADER, record.id.encode()))
                if record.prefix_miss is not None:
                    headers.append((MISS_HEADER, miss_header(record.prefix_miss)))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        body_bytes = 0
        state = scope["state"]

        async def counting_receive() -> Any:
            nonlocal body_bytes
            message = await receive()
            kind = message.get("type")
            if kind == "http.request":
                body_bytes += len(message.get("body") or b"")
                record.body_bytes = body_bytes
            elif kind == "http.disconnect" and not started:  # before any answer: it hung up on its body
                state[CLIENT_GONE] = True
            return message

        token = CURRENT.set(record)
        crashed = False
        try:
            await self.app(scope, counting_receive, send_with_id)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as exc:  # past Litestar's handlers (they take Exception): a panic in a native library
            crashed = True
            log.error("unhandled %s in %s %s: %s", type(exc).__name__, scope.get("method", "?"),
                      _printable(scope.get("path", "")), exc)
            if started:
                raise
            await send_with_id({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json")]})
            await send_with_id({"type": "http.response.body", "body": json.dumps({"error": {
                "message": f"internal error: {type(exc).__name__}", "type": "server_error", "param": None,
                "code": None}}).encode()})
        finally:
            if started and not ended and not crashed:
                status = 499  # the client went away before the body was complete
            CURRENT.reset(token)
            if self.trim is not None:
                self.trim.after_request(body_bytes)
            if not started and state.get(CLIENT_GONE):
                status = CLIENT_CLOSED
            path = scope.get("path", "")
            route = scope.get("path_template") or path
            level = logging.DEBUG if path in POLLED else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "%s", summary(record, scope.get("method", "?"), route, status, time.monotonic()))

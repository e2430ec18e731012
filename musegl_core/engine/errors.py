"""The engine's errors, each written once as the API reports it.

The engine fails a request by emitting a :class:`~musegl_core.engine.events.Failed`
built from one of these :class:`~musegl_core.errors.ApiError` values (status,
type, code, param, metadata, ``Retry-After``); the front maps that event to its
surface's error body (:mod:`musegl_core.http`, the API surface plugins) and
does not read the engine's reasons in any other way.
"""

from __future__ import annotations

import math
import time

from musegl_core.engine.sessions import CapacityError, SaltMismatch, SessionTable
from musegl_core.errors import ApiError


def context_error(prompt_tokens: int, reservation: int, max_context: int, source: str = "worker") -> ApiError:
    """400 ``context_length_exceeded`` with the counts a client needs to compact."""
    budget = max_context - reservation
    return ApiError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt_tokens + reservation} tokens ({prompt_tokens} in the messages, {reservation} in the "
        f"completion). Please reduce the length of the messages or completion.",
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
        metadata={
            "context_length": max_context,
            "prompt_tokens": prompt_tokens,
            "max_prompt_tokens": budget,
            "completion_reservation": reservation,
            "source": source,
        },
    )


def busy_error(running: int, queued: int, retry_after: int) -> ApiError:
    """503 ``server_busy``: every running place and every queue place is taken."""
    return ApiError(503, f"the server is busy: {running} requests run (--max-inflight-requests) and {queued} "
                    f"wait (--max-queued-requests, full); retry in about {retry_after} s",
                    "unavailable_error", "server_busy", retry_after=retry_after)


def duplicate_id(request_id: str) -> ApiError:
    return ApiError(400, f"duplicate request id {request_id}")


def salt_mismatch(exc: SaltMismatch) -> ApiError:
    """400 ``cache_salt_mismatch``: a named session keeps its first request's salt."""
    return ApiError(400, f"{exc}: a named session keeps the cache_salt of its first "
                    "request (close it with DELETE /v1/sessions/{id} to change it)",
                    "invalid_request_error", "cache_salt_mismatch", "cache_salt")


def capacity_error(exc: CapacityError, table: SessionTable) -> ApiError:
    """503 ``session_capacity``; its ``Retry-After`` is only what is known: with
    ``--session-idle-timeout``, when the first named session can expire (absent otherwise:
    no slot frees until a client deletes a session)."""
    retry = None
    if table.idle_timeout is not None and table.named:
        now = time.monotonic()
        idle = [s.last_used + table.idle_timeout - now for s in table.named.values() if s.idle]
        retry = max(1, math.ceil(min(idle) if idle else table.idle_timeout))
        when = f"the first named session can expire in about {retry} s (--session-idle-timeout)"
    else:
        when = "named sessions persist until DELETE /v1/sessions/{id}"
    return ApiError(503, f"no session slot is free: {exc}; {when}", "unavailable_error", "session_capacity",
                    retry_after=retry)


def no_session(name: str) -> ApiError:
    """404 ``session_not_found`` (closing a session that does not exist)."""
    return ApiError(404, f"no session {name!r}", "not_found_error", "session_not_found", "session_id")


def session_active(name: str) -> ApiError:
    """409 ``session_active`` (closing a session with a request running or queued)."""
    return ApiError(409, f"session {name!r} has a request running or queued; close it when idle",
                    "invalid_request_error", "session_active", "session_id")


def constraint_failure(processors) -> ApiError | None:
    """The error of a logits processor that can no longer enforce its
    constraint (its ``failure`` attribute: :class:`~musegl_core.constrain.matcher.GrammarProcessor`),
    or None. The request then fails (400 ``constraint_failed``) rather than
    go on unconstrained."""
    for processor in processors:
        reason = getattr(processor, "failure", None)
        if reason:
            return ApiError(400, f"the output constraint could not be enforced: the grammar engine failed "
                                 f"during generation ({reason}); simplify the schema",
                            "invalid_request_error", "constraint_failed")
    return None


def execution_failed(exc: Exception) -> ApiError:
    """500: the executor failed the step the request was in (the worker goes on)."""
    return ApiError(500, f"model execution failed: {exc}", "server_error")


def image_encoding_failed(exc: Exception) -> ApiError:
    """500: the executor could not encode the request's image (that request alone fails)."""
    return ApiError(500, f"image encoding failed: {exc}", "server_error")

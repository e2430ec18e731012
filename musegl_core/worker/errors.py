"""The one table from what the engine and the worker report to what a client sees.

The engine fails a request with an error kind and its details
(:mod:`musegl_core.engine.errors`; the worker's own kinds are in
:mod:`musegl_core.worker.messages`); :func:`api_error` gives each kind its
status, type, code, param, message, metadata and ``Retry-After`` as an
:class:`~musegl_core.errors.ApiError`, which every surface renders in its
envelope (:mod:`musegl_core.http`, the API surface plugins). A kind missing
from :data:`TABLE` is a 500 ``server_error``.
"""

from __future__ import annotations

from typing import Callable

from musegl_core.engine import errors as e
from musegl_core.errors import ApiError
from musegl_core.worker import messages as m


def _context(error: e.ContextTooLong) -> ApiError:
    """400 ``context_length_exceeded`` with the counts a client needs to compact
    (``prompt_tokens_exact`` false: the prompt tokens are a lower bound)."""
    requested, prompt, reservation = error.prompt_tokens + error.reservation, error.prompt_tokens, error.reservation
    if error.exact:
        asked = f"{requested} tokens ({prompt} in the messages, {reservation} in the completion)"
    else:
        asked = f"at least {requested} tokens (at least {prompt} in the messages, {reservation} in the completion)"
    metadata = {
        "context_length": error.max_context,
        "prompt_tokens": prompt,
        "max_prompt_tokens": error.max_context - reservation,
        "completion_reservation": reservation,
        "source": "worker",
    }
    if not error.exact:
        metadata["prompt_tokens_exact"] = False
    return ApiError(400, f"This model's maximum context length is {error.max_context} tokens. However, you "
                         f"requested {asked}. Please reduce the length of the messages or completion.",
                    "invalid_request_error", "context_length_exceeded", "messages", metadata=metadata)


def _busy(error: e.Busy) -> ApiError:
    return ApiError(503, f"the server is busy: {error.running} requests run (--max-inflight-requests) and "
                         f"{error.queued} wait (--max-queued-requests, full); retry in about {error.retry_after} s",
                    "unavailable_error", "server_busy", retry_after=error.retry_after)


def _no_slot(error: e.NoSessionSlot) -> ApiError:
    if error.retry_after is not None:
        when = f"the first named session can expire in about {error.retry_after} s (--session-idle-timeout)"
    else:
        when = "named sessions persist until DELETE /v1/sessions/{id}"
    return ApiError(503, f"no session slot is free: {error.reason}; {when}", "unavailable_error",
                    "session_capacity", retry_after=error.retry_after)


#: each kind → its ApiError
TABLE: dict[type[e.EngineError], Callable[..., ApiError]] = {
    e.ContextTooLong: _context,
    e.Busy: _busy,
    e.DuplicateId: lambda error: ApiError(400, f"duplicate request id {error.request_id}"),
    e.SaltMismatchError: lambda error: ApiError(
        400, f"{error.reason}: a named session keeps the cache_salt of its first request (close it with "
             "DELETE /v1/sessions/{id} to change it)", "invalid_request_error", "cache_salt_mismatch", "cache_salt"),
    e.NoSessionSlot: _no_slot,
    e.NoSession: lambda error: ApiError(404, f"no session {error.name!r}", "not_found_error", "session_not_found",
                                        "session_id"),
    e.SessionActive: lambda error: ApiError(
        409, f"session {error.name!r} has a request running or queued; close it when idle",
        "invalid_request_error", "session_active", "session_id"),
    e.ConstraintFailed: lambda error: ApiError(
        400, f"the output constraint could not be enforced: the grammar engine failed during generation "
             f"({error.reason}); simplify the schema", "invalid_request_error", "constraint_failed"),
    e.ExecutionFailed: lambda error: ApiError(500, f"model execution failed: {error.reason}", "server_error"),
    e.ImageEncodingFailed: lambda error: ApiError(500, f"image encoding failed: {error.reason}", "server_error"),
    m.FrameTooLarge: lambda error: ApiError(413, f"request frame over {error.limit} bytes", "invalid_request_error",
                                            "request_too_large"),
    m.BadFrame: lambda error: ApiError(400, error.reason, "invalid_request_error"),
    m.EventTooLarge: lambda error: ApiError(500, f"an output frame exceeded {error.limit >> 20} MiB",
                                            "server_error"),
    m.BadEvent: lambda error: ApiError(500, f"the worker sent an unreadable event: {error.reason}", "server_error"),
    m.PreparationFailed: lambda error: ApiError(500, f"preparing the request failed: {error.reason}",
                                                "server_error"),
    m.InputRefused: lambda error: ApiError(error.status, error.message, error.type, error.code, error.param,
                                           dict(error.metadata), error.retry_after),
}


def api_error(error: e.EngineError) -> ApiError:
    """What a client sees of ``error``."""
    render = TABLE.get(type(error))
    if render is None:
        return ApiError(500, f"the request failed ({error.kind})", "server_error")
    return render(error)

"""Anthropic's error envelope: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The error ``type`` follows the HTTP status as Anthropic's API has it
(400 ``invalid_request_error``, 401 ``authentication_error``, 403
``permission_error``, 404 ``not_found_error``, 413 ``request_too_large``,
429 ``rate_limit_error``, 500 and other 5xx ``api_error``, 529
``overloaded_error``). musegl's 503s (queue full, no session slot, the model
loading or restarting, the preflight timeout, shutdown) go out as **529
``overloaded_error``**, Anthropic's status for "try again shortly", with the
``retry-after`` header when the server knows when. The message keeps musegl's
text, and names the parameter where there is one.
"""

from __future__ import annotations

import attrs

from musegl_core.errors import ApiError

OVERLOADED = 529
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


@attrs.frozen
class ErrorDetail:
    type: str
    message: str


@attrs.frozen
class ErrorEnvelope:
    """An error response body, and the data of an ``error`` stream event."""

    error: ErrorDetail
    type: str = "error"


def status_of(error: ApiError) -> int:
    """The HTTP status Anthropic's clients get: 503 becomes 529."""
    return OVERLOADED if error.status == 503 else error.status


def envelope(error: ApiError) -> ErrorEnvelope:
    status = status_of(error)
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return ErrorEnvelope(ErrorDetail(kind, message))

"""Errors that carry their client-facing shape, and configuration errors."""

from __future__ import annotations

import attrs


class ConfigError(Exception):
    """A bad command-line value or missing plugin: one line, exit status 2."""


@attrs.define(eq=False)
class ApiError(Exception):
    """An error that reaches a client as an OpenAI-style error object.

    ``status`` is the HTTP status; ``type`` and ``code`` are the stable
    values documented in ``docs/protocol.md`` and ``docs/serving.md``.
    ``metadata`` carries machine-readable details that dialects may
    expose (context-overflow counts, for example). ``retry_after`` adds a
    ``Retry-After`` header (seconds).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    metadata: dict = attrs.field(factory=dict)
    retry_after: int | None = None

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, *, code: str | None = None, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


def unsupported(param: str, message: str) -> ApiError:
    """400 ``unsupported_parameter``: a parameter (or value) the server does not implement."""
    return bad_request(message, code="unsupported_parameter", param=param)


def unavailable(message: str, *, code: str | None = None, retry_after: int | None = 1) -> ApiError:
    return ApiError(503, message, "unavailable_error", code, None, retry_after=retry_after)


def server_error(message: str, *, code: str | None = None) -> ApiError:
    return ApiError(500, message, "server_error", code)


def shutting_down() -> ApiError:
    """503 ``server_shutting_down``: the request was cut short (or refused) by shutdown."""
    return unavailable("the server is shutting down", code="server_shutting_down", retry_after=None)

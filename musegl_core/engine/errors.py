"""What the engine reports when it fails a request: an error kind and its details.

The engine fails a request by emitting :class:`~musegl_core.engine.events.Failed`
with one of these values. Each names what happened (its ``kind``) and carries
the details a client may need (counts, a reason, a retry estimate); none says
how an API reports it. The front maps each kind once, in one table
(:mod:`musegl_core.worker.errors`), to the status, type, code and message its
surfaces render (:mod:`musegl_core.http`, the API surface plugins).

The worker adds a few kinds of its own (frames, preparation) in
:mod:`musegl_core.worker.messages`; every kind is a subclass of
:class:`EngineError` and crosses the pipe as ``{"kind": ..., details}``.
"""

from __future__ import annotations

import math
import time
from typing import ClassVar

import attrs

from musegl_core.engine.retention import idle_timeout
from musegl_core.engine.sessions import CapacityError, SaltMismatch, SessionTable


@attrs.frozen
class EngineError:
    """Base of every error kind; ``kind`` names it on the pipe."""

    kind: ClassVar[str] = "engine_error"


@attrs.frozen
class ContextTooLong(EngineError):
    """The prompt and the completion's reservation do not fit ``max_context``.
    ``exact`` False: ``prompt_tokens`` is a lower bound (the prompt was refused
    before it was fully tokenized)."""

    kind: ClassVar[str] = "context_too_long"
    prompt_tokens: int
    reservation: int
    max_context: int
    exact: bool = True


@attrs.frozen
class Busy(EngineError):
    """Every running place and every queue place is taken; ``retry_after``:
    seconds until a queue place is expected to free."""

    kind: ClassVar[str] = "busy"
    running: int
    queued: int
    retry_after: int


@attrs.frozen
class DuplicateId(EngineError):
    """A request arrived with the id of one still running or queued."""

    kind: ClassVar[str] = "duplicate_id"
    request_id: str


@attrs.frozen
class SaltMismatchError(EngineError):
    """A named session's request came with another ``cache_salt`` than its first."""

    kind: ClassVar[str] = "salt_mismatch"
    reason: str


@attrs.frozen
class NoSessionSlot(EngineError):
    """No session slot is free and none frees while the request waits.
    ``retry_after``: when the first named session can expire (with an idle
    timeout), None when no slot frees on its own."""

    kind: ClassVar[str] = "no_session_slot"
    reason: str
    retry_after: int | None = None


@attrs.frozen
class NoSession(EngineError):
    """Closing a named session that does not exist."""

    kind: ClassVar[str] = "no_session"
    name: str


@attrs.frozen
class SessionActive(EngineError):
    """Closing a named session with a request running, queued or in preparation."""

    kind: ClassVar[str] = "session_active"
    name: str


@attrs.frozen
class ConstraintFailed(EngineError):
    """A logits processor can no longer enforce its output constraint."""

    kind: ClassVar[str] = "constraint_failed"
    reason: str


@attrs.frozen
class ExecutionFailed(EngineError):
    """The executor failed the step the request was in (the worker goes on)."""

    kind: ClassVar[str] = "execution_failed"
    reason: str


@attrs.frozen
class ImageEncodingFailed(EngineError):
    """The executor could not encode the request's image (that request alone fails)."""

    kind: ClassVar[str] = "image_encoding_failed"
    reason: str


#: the engine's kinds (the worker's are in :data:`musegl_core.worker.messages.WORKER_ERRORS`)
ENGINE_ERRORS: tuple[type[EngineError], ...] = (
    ContextTooLong, Busy, DuplicateId, SaltMismatchError, NoSessionSlot, NoSession, SessionActive,
    ConstraintFailed, ExecutionFailed, ImageEncodingFailed,
)


def salt_mismatch(exc: SaltMismatch) -> SaltMismatchError:
    return SaltMismatchError(str(exc))


def capacity_error(exc: CapacityError, table: SessionTable) -> NoSessionSlot:
    """:class:`NoSessionSlot`; its ``retry_after`` is only what is known: with
    ``--session-idle-timeout``, when the first named session can expire (None
    otherwise: no slot frees until a client deletes a session)."""
    retry = None
    if table.idle_timeout is not None and table.named:
        now = time.monotonic()
        idle = [s.last_used + idle_timeout(table.idle_timeout, s.retention) - now
                for s in table.named.values() if s.idle]
        retry = max(1, math.ceil(min(idle) if idle else table.idle_timeout))
    return NoSessionSlot(str(exc), retry)


def constraint_failure(processors) -> ConstraintFailed | None:
    """The failure of a logits processor that can no longer enforce its
    constraint (its ``failure`` attribute: :class:`~musegl_core.constrain.matcher.GrammarProcessor`),
    or None. The request then fails rather than go on unconstrained."""
    for processor in processors:
        reason = getattr(processor, "failure", None)
        if reason:
            return ConstraintFailed(str(reason))
    return None

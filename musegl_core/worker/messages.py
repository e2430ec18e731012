"""Framing of the messages between the front and the worker, one JSON object per line.

The domain types (the request, its prompt segments, the events it produces)
live in :mod:`musegl_core.engine.request` and :mod:`musegl_core.engine.events`;
this module only adds the process-level messages (cancel, stats, ready) and
turns all of them into frames and back.

Each frame is a JSON object whose ``op`` names its class (but one, below). Requests travel
front → worker, events worker → front, multiplexed by request ``id``.
Frame limits: a request frame, newline included, is at most
``--max-request-bytes``; an event frame at most :data:`MAX_EVENT_FRAME`.

The one frame sent per decode step, :class:`Tokens`, is a JSON array instead
(:func:`tokens_frame`): ``["t", id, ids, text]``, with a fifth element when
the request asked for logprobs (``[[logprob, top_ids, top_logprobs], ...]``).
It is written and read without the converter, so a generated token costs one
``json.dumps`` and one ``json.loads`` and no attrs-to-dict pass on either side.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Union

import attrs
import cattrs

from musegl_core.config import ServeConfig
from musegl_core.engine.errors import ENGINE_ERRORS, EngineError
from musegl_core.engine.events import Admitted, Done, Failed, Started, Tokens
from musegl_core.engine.executor import ModelInfo, TokenLogprobs
from musegl_core.engine.request import GenerateRequest, PromptSegment
from musegl_core.engine.sessions import SessionInfo
from musegl_core.errors import ApiError

MAX_EVENT_FRAME = 1 << 20  # 1 MiB, newline included


# -- front → worker -----------------------------------------------------------------
@attrs.frozen
class Setup:
    """The first frame on the worker's stdin: the settings it runs with.

    Sent over the pipe, never on the command line (``/proc/PID/cmdline`` is
    world-readable), and without what the worker does not need: the front
    strips the API key (:func:`musegl_core.worker.client.worker_setup`)."""

    config: ServeConfig
    log_level: str = "info"


#: A generation request (defined with the engine's domain types).
Generate = GenerateRequest


@attrs.frozen
class Cancel:
    id: str


@attrs.frozen
class Stats:
    """Ask the worker for its engine counters (answered by a ``StatsReport``)."""

    id: str


@attrs.frozen
class ListSessions:
    """Ask for the named sessions (answered by a ``SessionList``)."""

    id: str


@attrs.frozen
class CloseSession:
    """Close an idle named session (answered by ``SessionClosed``, or ``Failed`` with
    ``NoSession`` or ``SessionActive``)."""

    id: str
    session_id: str


# -- worker → front -----------------------------------------------------------------
@attrs.frozen
class Capacity:
    max_context: int
    max_sessions: int
    max_inflight_requests: int
    max_decode_sequences: int


@attrs.frozen
class Ready:
    model: ModelInfo
    capacity: Capacity
    pid: int


@attrs.frozen
class StatsReport:
    id: str
    values: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class SessionList:
    id: str
    sessions: tuple[SessionInfo, ...] = ()


@attrs.frozen
class SessionClosed:
    id: str
    session_id: str


# -- the worker's own error kinds (beside the engine's: musegl_core.engine.errors) ---------
@attrs.frozen
class FrameTooLarge(EngineError):
    """A request frame over ``--max-request-bytes`` (``limit``)."""

    kind: ClassVar[str] = "frame_too_large"
    limit: int


@attrs.frozen
class BadFrame(EngineError):
    """A request frame that is not a valid message."""

    kind: ClassVar[str] = "bad_frame"
    reason: str


@attrs.frozen
class EventTooLarge(EngineError):
    """An event of the request did not fit one event frame (:data:`MAX_EVENT_FRAME`)."""

    kind: ClassVar[str] = "event_too_large"
    limit: int = MAX_EVENT_FRAME


@attrs.frozen
class BadEvent(EngineError):
    """The front could not read an event frame the worker sent for the request (a
    :class:`Tokens` frame whose logprobs do not pair with its ids, say): the request
    fails rather than lose that output; the worker goes on serving the others."""

    kind: ClassVar[str] = "bad_event"
    reason: str


@attrs.frozen
class PreparationFailed(EngineError):
    """Preparing the request failed for a reason other than its input (a bug, a library's panic)."""

    kind: ClassVar[str] = "preparation_failed"
    reason: str


@attrs.frozen
class InputRefused(EngineError):
    """Preparation refused the request's input. Its checks (tokenizing, images,
    output constraints: :mod:`musegl_core.worker.prepare`) are shared with
    ``musegl generate`` and ``musegl render`` and raise
    :class:`~musegl_core.errors.ApiError`; that error crosses as it is."""

    kind: ClassVar[str] = "input_refused"
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    retry_after: int | None = None

    @classmethod
    def of(cls, error: ApiError) -> InputRefused:
        return cls(error.status, error.message, error.type, error.code, error.param, dict(error.metadata),
                   error.retry_after)


WORKER_ERRORS: tuple[type[EngineError], ...] = (FrameTooLarge, BadFrame, EventTooLarge, BadEvent,
                                                 PreparationFailed, InputRefused)
#: every error kind that crosses the pipe, by its ``kind``
ERROR_KINDS: dict[str, type[EngineError]] = {cls.kind: cls for cls in (*ENGINE_ERRORS, *WORKER_ERRORS)}


Request = Union[Setup, Generate, Cancel, Stats, ListSessions, CloseSession]
Event = Union[Ready, Admitted, Started, Tokens, Done, Failed, StatsReport, SessionList, SessionClosed]
_OPS: dict[str, type] = {
    "setup": Setup, "generate": GenerateRequest, "cancel": Cancel, "stats": Stats, "listsessions": ListSessions,
    "closesession": CloseSession, "ready": Ready, "admitted": Admitted, "started": Started, "done": Done,
    "failed": Failed, "statsreport": StatsReport, "sessionlist": SessionList, "sessionclosed": SessionClosed,
}
_NAMES = {cls: op for op, cls in _OPS.items()}

converter = cattrs.Converter(omit_if_default=True)


def _unstructure_error(error: EngineError) -> dict[str, Any]:
    return {"kind": error.kind, **converter.unstructure(error, type(error))}


def _structure_error(value: Any, _: type) -> EngineError:
    """An error kind from ``{"kind": ..., details}``; an unknown kind is a malformed frame."""
    details = dict(value)
    cls = ERROR_KINDS[details.pop("kind")]
    return converter.structure(details, cls)


# a field typed EngineError (Failed.error) holds any kind: only the base takes these hooks
converter.register_unstructure_hook_func(lambda cls: cls is EngineError, _unstructure_error)
converter.register_structure_hook_func(lambda cls: cls is EngineError, _structure_error)


class FrameError(ValueError):
    """A frame that is too large or not a valid message; ``id`` is the request it names
    when that much of it could be read (a malformed :class:`Tokens` frame's), else None."""

    def __init__(self, message: str, id: str | None = None) -> None:
        super().__init__(message)
        self.id = id


#: the first element of a compact :class:`Tokens` frame
TOKENS_TAG = "t"


def tokens_frame(event: Tokens) -> list[Any]:
    """A :class:`Tokens` event as its compact frame (before JSON)."""
    frame: list[Any] = [TOKENS_TAG, event.id, event.ids, event.text]
    if event.logprobs:
        frame.append([[entry.logprob, entry.top_ids, entry.top_logprobs] for entry in event.logprobs])
    return frame


def _tokens(frame: list[Any]) -> Tokens:
    """The :class:`Tokens` event of a compact frame; a wrong shape is a ``ValueError``."""
    if not 4 <= len(frame) <= 5 or frame[0] != TOKENS_TAG:
        raise ValueError("not a tokens frame")
    _, rid, ids, text, *logprobs = frame
    if not (isinstance(rid, str) and isinstance(text, str) and isinstance(ids, list)
            and all(type(i) is int for i in ids)):
        raise ValueError("a tokens frame holds an id string, a list of ids and a text")
    entries = tuple(TokenLogprobs(float(logprob), tuple(map(int, top_ids)), tuple(map(float, top_logprobs)))
                    for logprob, top_ids, top_logprobs in (logprobs[0] if logprobs else ()))
    if logprobs and len(entries) != len(ids):
        raise ValueError("a tokens frame has one logprobs entry per id")
    return Tokens(rid, tuple(ids), text, entries)


def encode(message: Any, limit: int | None = None) -> bytes:
    if type(message) is Tokens:
        payload: Any = tokens_frame(message)
    else:
        payload = converter.unstructure(message)
        payload["op"] = _NAMES[type(message)]
    line = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    if limit is not None and len(line) > limit:
        raise FrameError(f"frame of {len(line)} bytes exceeds the {limit}-byte limit")
    return line


def decode(line: bytes | str) -> Any:
    payload: Any = None
    try:
        payload = json.loads(line)
        if isinstance(payload, list):
            return _tokens(payload)
        cls = _OPS[payload.pop("op")]
        return converter.structure(payload, cls)
    except (ValueError, KeyError, TypeError, cattrs.BaseValidationError) as exc:
        rid = payload[1] if isinstance(payload, list) and len(payload) > 1 and isinstance(payload[1], str) else None
        raise FrameError(f"malformed frame: {exc}", rid) from exc

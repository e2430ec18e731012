"""Messages between the front and the worker, one JSON object per line.

Each frame is a JSON object whose ``op`` names its class. Requests travel
front → worker, events worker → front, multiplexed by request ``id``.
Frame limits (the seed's): a request frame, newline included, is at most
``--max-request-bytes``; an event frame at most :data:`MAX_EVENT_FRAME`.
"""

from __future__ import annotations

import json
from typing import Any, Union

import attrs
import cattrs

from musegl_core.engine.executor import ModelInfo, SamplingParams
from musegl_core.engine.sessions import SessionInfo

MAX_EVENT_FRAME = 1 << 20  # 1 MiB, newline included


# -- front → worker -----------------------------------------------------------------
@attrs.frozen
class PromptSegment:
    """A piece of the prompt: text, or token ids.

    Exactly one of ``text`` and ``token_ids`` is set. With ``special=True`` the
    special-token strings written in ``text`` (``<|start|>``) become their
    single ids; with ``special=False`` (text a client typed) they stay literal
    text, so a user who types ``<|eot|>`` never injects a control token.
    Image segments join in the vision issue."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    special: bool = True


@attrs.frozen
class Generate:
    id: str
    prompt: tuple[PromptSegment, ...]
    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # request stops (win over template stops)
    template_stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str | None = None
    add_bos: bool = True  # False: the prompt is used exactly as given (musegl generate)
    stream: bool = False  # a streamed request confirms a new session on its first output


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
    """Close an idle named session (answered by ``SessionClosed`` or ``Failed``: 404, 409)."""

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
class Started:
    """Generation is ready: the prompt is prefilled (headers may be sent)."""

    id: str
    prompt_tokens: int
    cached_tokens: int = 0


@attrs.frozen
class Tokens:
    """Newly generated token ids and the text they completed (special tokens
    written out; EOS excluded; text held back while it may start a stop).

    ``ids`` holds every id generated since the previous ``Tokens`` event, so
    the ids of all events concatenated are the generated ids (up to those
    still held back when generation ends, which ``Done.generated_ids`` has)."""

    id: str
    ids: tuple[int, ...]
    text: str


@attrs.frozen
class Done:
    id: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    matched_stop: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    generated_ids: tuple[int, ...] | None = None  # None when stop-trimmed


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


@attrs.frozen
class Failed:
    id: str | None
    status: int
    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)


Request = Union[Generate, Cancel, Stats, ListSessions, CloseSession]
Event = Union[Ready, Started, Tokens, Done, Failed, StatsReport, SessionList, SessionClosed]
_OPS: dict[str, type] = {
    cls.__name__.lower(): cls
    for cls in (Generate, Cancel, Stats, ListSessions, CloseSession, Ready, Started, Tokens, Done, Failed,
                StatsReport, SessionList, SessionClosed)
}

converter = cattrs.Converter(omit_if_default=True)


class FrameError(ValueError):
    """A frame that is too large or not a valid message."""


def encode(message: Any, limit: int | None = None) -> bytes:
    payload = converter.unstructure(message)
    payload["op"] = type(message).__name__.lower()
    line = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    if limit is not None and len(line) > limit:
        raise FrameError(f"frame of {len(line)} bytes exceeds the {limit}-byte limit")
    return line


def decode(line: bytes | str) -> Any:
    try:
        payload = json.loads(line)
        cls = _OPS[payload.pop("op")]
        return converter.structure(payload, cls)
    except (ValueError, KeyError, TypeError, cattrs.BaseValidationError) as exc:
        raise FrameError(f"malformed frame: {exc}") from exc

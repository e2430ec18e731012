"""Which session a request runs in: its own, or a soft one named by the client's conversation key.

Stateless agent clients resend the whole conversation every turn and never
name a musegl session, but they do send a key of their own that stays the
same for one conversation: Claude Code's ``X-Claude-Code-Session-Id``, a
Responses ``prompt_cache_key``, Codex's ``session-id`` / ``thread-id``.
:func:`client_session` turns the first such key into a **soft session**
(``GenerateRequest.soft_session``): the worker keeps its KV between turns like
a named session's, so turn 2 executes only its suffix, but a soft session

* closes after ``--soft-session-idle-timeout`` seconds idle (default 600),
* is the first to be evicted (LRU) when a request needs a slot,
* never makes a request wait or fail: when it is busy with another request,
  when it is new and no slot is free, or when another, longer conversation
  of the same key holds it, the request runs anonymously on the prefix cache.

An explicit session (``session_id`` / ``X-Session-Id``) always wins and is
an ordinary named session.
"""

from __future__ import annotations

import hashlib
import re
from typing import Iterable

SOFT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,100}")

#: The agent clients' conversation headers, ``(source, header)`` in order of preference:
#: Claude Code's, then Codex's (``session-id`` and ``thread-id`` carry the same value), then
#: opencode's ``x-session-affinity`` (see :func:`explicit_header_session`).
CLIENT_KEY_HEADERS = (("claude-code", "x-claude-code-session-id"), ("codex", "session-id"), ("codex", "thread-id"),
                      ("opencode", "x-session-affinity"))
#: The header a client sends beside ``X-Session-Id`` (with the same value) when that id is its own
#: conversation key rather than a session it asks the server to keep: opencode sends both on every
#: request of a conversation.
AFFINITY_HEADER = "x-session-affinity"
#: The source of a body's ``prompt_cache_key`` (the Responses surface names it the same way).
PROMPT_CACHE_KEY_SOURCE = "codex"
MAX_CLIENT_KEY = 1024


def header_keys(headers) -> list[tuple[str, str | None]]:
    """The :data:`CLIENT_KEY_HEADERS` a request carries (a mapping with ``get``)."""
    return [(source, headers.get(name)) for source, name in CLIENT_KEY_HEADERS]


def peer_key(request) -> str | None:
    """The admission fairness key of an HTTP request (``RequestOptions.client``): its
    peer's address (None when unknown). Not the API key, which every client of a
    server shares, nor a session key, which a client chooses freely (docs/sessions.md)."""
    client = getattr(request, "client", None)
    return getattr(client, "host", None) or None


def explicit_header_session(headers) -> str | None:
    """The session an ``X-Session-Id`` header names on purpose (a mapping with ``get``), or None.

    A request whose ``x-session-affinity`` header carries the same value sends
    its client's own conversation key (opencode does, on every request of a
    conversation, its title request included): that key names a soft session
    (``opencode:<key>``, through :data:`CLIENT_KEY_HEADERS`), which a client's
    ordinary use cannot pile up into a locked server (docs/sessions.md)."""
    value = headers.get("x-session-id")
    if value is not None and headers.get(AFFINITY_HEADER) == value:
        return None
    return value


def soft_session_name(source: str, key: str) -> str:
    """The session name for a client key: ``<source>:<key>`` when the key is
    1-100 characters of ``A-Z a-z 0-9 . _ : -`` (a UUID is), else
    ``<source>:sha256-<40 hex digits of the key's digest>``."""
    if SOFT_NAME.fullmatch(key):
        return f"{source}:{key}"
    return f"{source}:sha256-{hashlib.sha256(key.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}"


def private_session_name(source: str, secret: str) -> str:
    """The session name for a key that is a capability (a stored response's id, which
    lets its holder read, continue and delete the response): always
    ``<source>:sha256-<40 hex digits>``, so ``GET /v1/sessions`` never shows the key."""
    return f"{source}:sha256-{hashlib.sha256(secret.encode('utf-8', 'surrogatepass')).hexdigest()[:40]}"


def client_session(explicit: str | None, keys: Iterable[tuple[str, str | None]]) -> tuple[str | None, bool]:
    """``(session_id, soft)`` for a request.

    ``explicit`` is the request's own, already validated session name (None:
    none); ``keys`` are ``(source, value)`` pairs in order of preference, such
    as ``("claude-code", request.headers.get("x-claude-code-session-id"))``;
    empty or missing values are skipped."""
    if explicit is not None:
        return explicit, False
    for source, value in keys:
        if value:
            return soft_session_name(source, value), True
    return None, False


#: The response header that names the session a request ran in (the request header of the same name names it).
SESSION_HEADER = "X-Session-Id"


def session_echo(session_id: str | None, soft: bool) -> dict[str, str]:
    """The response headers that echo the named session a request ran in: ``X-Session-Id``,
    the header a router keys its session affinity by (docs/scaling.md). Nothing for an
    anonymous request, nor for a soft session, which may run anonymously after all."""
    return {SESSION_HEADER: session_id} if session_id is not None and not soft else {}

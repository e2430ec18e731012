"""Retention a client asks for, in its API's words, as the residency the engine honours.

* OpenAI's ``prompt_cache_retention`` (Chat Completions, Responses):
  ``in_memory`` (also spelled ``in-memory``) is residency ``5m``; ``24h`` is
  residency ``24h``, which needs the disk tier (``--kv-offload-dir``): without
  one, the request is served with ``in_memory`` and the response says so
  (:func:`granted`, :func:`retention_header`; the Responses API's
  ``prompt_cache_retention`` field too).
* Anthropic's ``cache_control`` (any block, tool, or the top level):
  ``{"type": "ephemeral"}`` with ``ttl`` ``5m`` (its default) or ``1h``; the
  request's residency is the longest ``ttl`` it names. Every server honours
  both (docs/sessions.md "Retention").

A value outside these is a 400 naming the parameter. The residencies are
:data:`musegl_core.engine.retention.RESIDENCIES`.
"""

from __future__ import annotations

from typing import Any, Iterable

from musegl_core.errors import bad_request

#: the response header that states the residency a request was granted, in its API's words
HEADER = "X-Prompt-Cache-Retention"

_OPENAI = {"in_memory": "5m", "in-memory": "5m", "24h": "24h"}
_OPENAI_NAMES = {"5m": "in_memory", "24h": "24h"}
_TTLS = ("5m", "1h")


def openai_retention(value: Any, param: str = "prompt_cache_retention") -> str | None:
    """``prompt_cache_retention``: ``in_memory`` or ``24h`` as a residency name (None: not given)."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in _OPENAI:
        raise bad_request(f"'{param}' must be 'in_memory' or '24h', got {value!r}", param=param)
    return _OPENAI[value]


def granted(asked: str | None, disk_tier: bool) -> str | None:
    """The residency a request asking ``asked`` gets on a server with or without a ``disk_tier``:
    ``24h`` needs the disk tier (it is what keeps a block a day, across restarts); without one it
    is ``5m`` (OpenAI's ``in_memory``)."""
    if asked == "24h" and not disk_tier:
        return "5m"
    return asked


def openai_name(residency: str | None) -> str | None:
    """A granted residency in OpenAI's words (``in_memory``, ``24h``)."""
    return None if residency is None else _OPENAI_NAMES.get(residency, residency)


def retention_header(residency: str | None, words=openai_name) -> dict[str, str]:
    """The response header stating the residency granted (``residency``: None when the request
    asked for none, then no header), in the API's words (``words``)."""
    if residency is None:
        return {}
    return {HEADER: words(residency)}


def anthropic_ttl(markers: Iterable[tuple[Any, str]]) -> str | None:
    """The residency of a Messages request from its ``cache_control`` values, each with the
    param it sits at: ``{"type": "ephemeral", "ttl": "5m" | "1h"}`` (``ttl`` defaults to ``5m``).
    The longest ``ttl`` wins; None when no block carries one. ``scope`` (a string; Claude Code
    sends it on system blocks) says who may share the cached prefix on Anthropic's side: here
    sharing is by ``cache_salt``, whatever the scope, so it is accepted and changes nothing."""
    found = None
    for value, param in markers:
        if value is None:
            continue
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be an object", param=param)
        unknown = sorted(key for key in set(value) - {"type", "ttl", "scope"} if value[key] is not None)
        if unknown:
            raise bad_request(f"'{param}.{unknown[0]}' is not supported by this server", param=f"{param}.{unknown[0]}")
        if value.get("type") != "ephemeral":
            raise bad_request(f"'{param}.type' must be 'ephemeral'", param=f"{param}.type")
        if value.get("scope") is not None and not isinstance(value["scope"], str):
            raise bad_request(f"'{param}.scope' must be a string", param=f"{param}.scope")
        ttl = value.get("ttl") or "5m"
        if ttl not in _TTLS:
            raise bad_request(f"'{param}.ttl' must be '5m' or '1h', got {ttl!r}", param=f"{param}.ttl")
        if found is None or _TTLS.index(ttl) > _TTLS.index(found):
            found = ttl
    return found

"""Retention a client asks for: how long, and in which tiers, a conversation's KV stays.

Clients ask in their API's words (Anthropic's ``cache_control.ttl``, OpenAI's
``prompt_cache_retention``; :mod:`musegl_core.service.retention` reads them);
the worker request carries one of the **residencies** below by name
(:attr:`~musegl_core.engine.request.RequestOptions.retention`), and the engine
honours it (docs/sessions.md "Retention"):

* an idle session is kept at least :attr:`Residency.seconds` after its last
  request (its idle timeout is the longer of its own and this), and while
  that time runs it is evicted only after the idle sessions of its kind that
  have no retention left (:func:`evict_order`);
* :attr:`Residency.write_through`: with a disk tier, the blocks a request
  leaves are written to disk when it ends (engine/kv_disk.py), so they
  survive the device's and the host's evictions and a restart of the worker.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Residency:
    name: str
    seconds: float  # an idle session is kept at least this long after its last request
    write_through: bool  # its blocks are written to the disk tier (when there is one) at the end of each request


#: by name: "5m" (Anthropic's default ``ttl``, OpenAI's ``in_memory``), "1h", "24h" (OpenAI's extended retention)
RESIDENCIES = {r.name: r for r in (Residency("5m", 300.0, False),
                                   Residency("1h", 3600.0, True),
                                   Residency("24h", 86400.0, True))}


def residency(name: str | None) -> Residency | None:
    if name is None:
        return None
    try:
        return RESIDENCIES[name]
    except KeyError:
        raise ValueError(f"unknown retention {name!r} ({', '.join(RESIDENCIES)})") from None


def idle_timeout(base: float | None, retention: str | None) -> float | None:
    """A session's idle timeout: its kind's (``base``; None: it never idles out) made at least
    as long as its retention's."""
    kept = residency(retention)
    if base is None or kept is None:
        return base
    return max(base, kept.seconds)


def retained(session, now: float) -> bool:
    """Whether ``session``'s retention still runs (idle for less than its residency's seconds)."""
    kept = residency(getattr(session, "retention", None))
    return kept is not None and now - session.last_used < kept.seconds


def evict_order(now: float):
    """A sort key for idle sessions of one kind, first to go first: those with no retention
    left, least recently used first, then those whose retention still runs."""
    return lambda session: (retained(session, now), session.last_used)

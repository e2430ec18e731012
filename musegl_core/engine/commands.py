"""What other threads ask of the engine: one class per command.

:class:`~musegl_core.engine.engine.Engine`'s thread-safe methods put these on
its inbox; the engine thread applies them between steps, in order.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from musegl_core.engine.request import PreparedRequest


@attrs.frozen
class Submit:
    """Admit a prepared request (queue it, start it when it may run)."""

    request: PreparedRequest


@attrs.frozen
class Cancel:
    """End a running request, or take a queued one out of the queue."""

    request_id: str


@attrs.frozen
class Stop:
    """Leave :meth:`~musegl_core.engine.engine.Engine.run_forever` after this batch of commands."""


@attrs.frozen
class Call:
    """Run ``function(stats)`` on the engine thread."""

    function: Callable[[dict], None]


@attrs.frozen
class ListSessions:
    """``reply(infos)``: every named session, after idle ones expired."""

    reply: Callable[[list], None]


@attrs.frozen
class CloseSession:
    """Close an idle named session; ``reply(None)`` or ``reply(error)``."""

    name: str
    reply: Callable[[Any], None]


@attrs.frozen
class ExpireIdle:
    """Apply ``--session-idle-timeout`` now."""


Command = Submit | Cancel | Stop | Call | ListSessions | CloseSession | ExpireIdle

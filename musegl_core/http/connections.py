"""Connections that hold a socket without sending a request: closed on time.

uvicorn's HTTP/1.1 protocol (h11) waits for a request's headers and body for
as long as the client keeps the socket open, and accepts every connection
it is offered. A client that opens thousands of sockets, each with part of
a request, holds the front's descriptors until none is left for anyone.
:func:`guarded_protocol` gives uvicorn a subclass of its h11 protocol with
three limits (flags of ``musegl serve``, docs/serving.md "Connections"):

* ``--header-timeout``: the request line and headers must have arrived this
  long after the connection opened (on a kept-alive connection: after the
  next request's first byte); else the connection is closed;
* ``--idle-timeout``: a connection the server is waiting on, between
  requests (keep-alive) or in the middle of a body, that sends nothing for
  this long is closed (the body's request then ends as 499);
* ``--max-connections``: a connection beyond this many open ones is closed
  as soon as it is accepted, so descriptors stay for the ones that are
  served (and for the worker, logs and model files).
"""

from __future__ import annotations

import asyncio
import logging

import attrs
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("musegl.http")


@attrs.frozen
class ConnectionLimits:
    header_timeout: float = 10.0
    idle_timeout: float = 30.0
    max_connections: int = 1000


class _Counters:
    refused = 0
    timed_out = 0


COUNTERS = _Counters()


def limits_of(config) -> ConnectionLimits:
    """The limits a :class:`~musegl_core.config.ServeConfig` sets."""
    return ConnectionLimits(config.header_timeout, config.idle_timeout, config.max_connections)


def uvicorn_options(config) -> dict:
    """``uvicorn.Config`` keywords for the limits of ``config``."""
    return {"http": guarded_protocol(limits_of(config)), "timeout_keep_alive": config.idle_timeout}


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                COUNTERS.refused += 1
                transport.abort()  # no bytes, no descriptor kept: the cap holds while a flood lasts
                return
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow_state()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive timer (--idle-timeout)
            self._cancel_timers()

        def _follow_state(self) -> None:
            if self.transport.is_closing():
                return
            state = self.conn.their_state
            if state is h11.IDLE:  # part of a request line or headers so far
                if self._header_timer is None:
                    self._arm_header_timer()
            elif state is h11.SEND_BODY:  # headers in: the body may not fall silent
                self._cancel_header_timer()
                if self._idle_timer is not None:
                    self._idle_timer.cancel()
                self._idle_timer = self.loop.call_later(limits.idle_timeout, self._timed_out, "idle")
            else:
                self._cancel_timers()

        def _arm_header_timer(self) -> None:
            self._header_timer = self.loop.call_later(limits.header_timeout, self._timed_out, "header")

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _cancel_timers(self) -> None:
            self._cancel_header_timer()
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None

        def _timed_out(self, which: str) -> None:
            self._header_timer = self._idle_timer = None
            if self.transport.is_closing():
                return
            if which == "idle" and self.flow.read_paused:  # the server stopped reading, not the client
                self._idle_timer = self.loop.call_later(limits.idle_timeout, self._timed_out, "idle")
                return
            COUNTERS.timed_out += 1
            log.debug("closing a connection from %s: %s timeout", self.client, which)
            self.transport.close()
            # h11 may still wait for the body: the request (if any) sees the disconnect
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()

    return GuardedH11Protocol

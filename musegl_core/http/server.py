"""Running the HTTP front: bind the port first, serve, shut down gracefully.

:func:`bind` opens the listening socket before anything announces it, so a
port in use is one clear error (``ConfigError``, exit status 2) instead of a
"listening on ..." line followed by a failure.

:class:`GracefulServer` is uvicorn's server with musegl's shutdown order. On
SIGINT or SIGTERM uvicorn stops accepting connections and waits for the open
ones; this class first tells the front (``on_shutdown``), which refuses new
requests on kept-alive connections and, after ``--shutdown-timeout`` seconds,
ends the requests still running with 503 ``server_shutting_down`` (an SSE
error event and ``[DONE]`` for a stream). uvicorn's own deadline is a little
later, so those error responses are delivered before it would cancel
anything. The worker runs in its own session, so a Ctrl-C in the terminal
reaches only the front, which stops the worker last (see
:mod:`musegl_core.worker.client`).
"""

from __future__ import annotations

import socket
from typing import Callable

import uvicorn

from musegl_core.errors import ConfigError

#: seconds uvicorn waits beyond ``--shutdown-timeout`` for the error responses to go out
DELIVERY_MARGIN = 5.0


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: any free port), ready for uvicorn.

    :raises ConfigError: when the address cannot be bound (in use, not local, ...).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock


class GracefulServer(uvicorn.Server):
    """uvicorn's server that tells the front when shutdown begins."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]):
        super().__init__(config)
        self._on_shutdown = on_shutdown

    @classmethod
    def create(cls, app, *, shutdown_timeout: float, on_shutdown: Callable[[], None],
               log_level: str = "info", serve_config=None) -> "GracefulServer":
        """A server for ``app``; run it with ``server.run(sockets=[bound socket])``. With
        ``serve_config``, its connection limits (http/connections.py) apply."""
        from musegl_core.http.connections import uvicorn_options

        config = uvicorn.Config(
            app,
            **(uvicorn_options(serve_config) if serve_config is not None else {}),
            log_level=log_level,
            log_config=None,  # uvicorn's lines go through musegl's format (musegl_core.logs)
            access_log=False,  # the front logs one summary line per request itself (http/request_log.py)
            timeout_graceful_shutdown=shutdown_timeout + DELIVERY_MARGIN,  # type: ignore[arg-type]
        )
        return cls(config, on_shutdown)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets)

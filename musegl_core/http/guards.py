"""Requests that a web page, not a client program, made: refused before any handler runs.

A server on ``127.0.0.1`` next to a browser is reachable by every page that
browser opens. Three checks, one guard on the whole application
(:func:`browser_guard`), each an :class:`~musegl_core.errors.ApiError` in the
envelope of the surface the path belongs to:

* **Content type** (every request with a body that a route reads as JSON:
  ``POST``, ``PUT``, ``PATCH``): a ``Content-Type`` other than JSON
  (``application/json`` or any ``+json`` type) is 415 ``unsupported_media_type``.
  Browsers send ``text/plain``, ``application/x-www-form-urlencoded`` and
  ``multipart/form-data`` cross-site without asking first (a CORS "simple
  request"); JSON needs a preflight, which a server without
  ``--cors-allow-origin`` never grants. A request without ``Content-Type``
  is read as JSON (``curl -d`` aside, programs send one; a browser page that
  omits it still sends ``Origin``, the next check).
* **Origin** (a server without ``--api-key``): a request whose ``Origin``
  header names another site than the server's own (its scheme, ``Host`` and
  port) and is not allowed by ``--cors-allow-origin`` is 403
  ``origin_not_allowed``. Browsers add ``Origin`` to every cross-origin
  request and to same-origin ones other than ``GET``/``HEAD``; programs
  (SDKs, curl) send none. With ``--api-key`` the check is left out: a page
  cannot add the ``Authorization`` header without a preflight.
* **Host** (a connection that arrived on a loopback address): the ``Host``
  header must name a loopback host (``localhost``, ``*.localhost``,
  ``127.0.0.0/8``, ``::1``), the ``--host`` given, or one of
  ``--allowed-host`` (``*``: any). A page on ``attacker.test`` whose name was
  rebound to ``127.0.0.1`` (DNS rebinding) reaches the server with
  ``Host: attacker.test``: 403 ``host_not_allowed``.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError

#: methods whose body a route reads as JSON
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, brackets allowed) is this machine's loopback."""
    host = host.strip().strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """``Host``'s name and port (``[::1]:8000`` -> ``("::1", 8000)``); a bad port is None."""
    try:
        parts = urlsplit("//" + value.strip())
        return (parts.hostname or "", parts.port)
    except ValueError:
        return ("", None)


def is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _bounded(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class BrowserGuard:
    """The three checks of this module for one server's settings."""

    def __init__(self, config: ServeConfig):
        self.check_origin = config.api_key is None
        origins = tuple(o.rstrip("/").lower() for o in config.cors_allow_origins)
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        hosts = tuple(h.strip().strip("[]").lower().rstrip(".") for h in config.allowed_hosts)
        self.any_host = "*" in hosts
        self.hosts = frozenset((*hosts, config.host.strip().strip("[]").lower()))

    def host_allowed(self, host_header: str) -> bool:
        name, _ = split_host(host_header)
        name = name.rstrip(".")
        return self.any_host or is_loopback(name) or name in self.hosts

    def origin_allowed(self, origin: str, host_header: str, scheme: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            return False  # "null" (a sandboxed or file: page) and anything unreadable
        if not parts.hostname:
            return False
        own_name, own_port = split_host(host_header)
        default = 443 if scheme == "https" else 80
        return (parts.scheme == scheme and parts.hostname == own_name.lower()
                and (port or (443 if parts.scheme == "https" else 80)) == (own_port or default))

    def check(self, scope: Any, headers: Any) -> None:
        """Raise the error for a request a browser page made, else nothing."""
        server = scope.get("server")
        host_header = headers.get("host", "")
        if server and is_loopback(str(server[0])) and not self.host_allowed(host_header):
            raise ApiError(403, f"the Host header {_bounded(host_header)!r} is not allowed on a server bound to "
                                "loopback (DNS rebinding); use localhost or 127.0.0.1, or start the server with "
                                "--allowed-host NAME", "permission_error", "host_not_allowed")
        origin = headers.get("origin")
        if self.check_origin and origin is not None and not self.origin_allowed(origin, host_header,
                                                                                 scope.get("scheme", "http")):
            raise ApiError(403, f"requests from the web page at {_bounded(origin)!r} are refused: this server has "
                                "no --api-key, so it takes cross-site requests only from origins given with "
                                "--cors-allow-origin", "permission_error", "origin_not_allowed")
        if scope.get("method") in BODY_METHODS:
            content_type = headers.get("content-type")
            if content_type is not None and not is_json(content_type):
                raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), got "
                                    f"Content-Type {_bounded(content_type)!r}", "invalid_request_error",
                               "unsupported_media_type")


def browser_guard(config: ServeConfig):
    """A Litestar guard running :meth:`BrowserGuard.check` on every route."""
    guard = BrowserGuard(config)

    async def check(connection: Any, _: Any) -> None:
        guard.check(connection.scope, connection.headers)

    return check

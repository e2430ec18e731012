"""A byte-capturing HTTP proxy for tests that drive real clients (Claude Code, Codex, opencode).

:func:`capturing_proxy` listens on a free local port and forwards every
request to ``upstream`` unchanged, recording each request's method, path,
headers and body, and the response's status, as :class:`Exchange` objects.
Responses stream through as they arrive (SSE included), so a client behind
the proxy behaves as it would against the server itself. A test reads
``proxy.exchanges`` to see exactly what the client sent, rather than
rebuilding the client's requests by hand.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import attrs

HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-authorization", "proxy-authenticate", "content-length"})


@attrs.define
class Exchange:
    """One request as the client sent it, and the status the server answered."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int | None = None


@attrs.define
class CapturingProxy:
    url: str
    exchanges: list[Exchange]


def _handler(upstream: urllib.parse.SplitResult, exchanges: list[Exchange], lock: threading.Lock):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            exchange = Exchange(self.command, self.path, headers, body)
            with lock:
                exchanges.append(exchange)
            connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=600)
            try:
                sent = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
                connection.request(self.command, self.path, body=body or None,
                                   headers={**sent, "Host": upstream.netloc})
                response = connection.getresponse()
                exchange.status = response.status
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if self.command != "HEAD":
                    while chunk := response.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away: so does the upstream request
            finally:
                connection.close()

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _forward

    return Handler


@contextlib.contextmanager
def capturing_proxy(upstream: str) -> Iterator[CapturingProxy]:
    """A proxy in front of ``upstream`` (``http://host:port``) for the ``with`` block."""
    exchanges: list[Exchange] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(urllib.parse.urlsplit(upstream), exchanges,
                                                            threading.Lock()))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="capturing-proxy", daemon=True)
    thread.start()
    try:
        yield CapturingProxy(f"http://127.0.0.1:{server.server_address[1]}", exchanges)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)

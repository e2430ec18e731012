"""Logging: one format for the front and the worker, at the level ``--log-level`` names.

Both processes write to stderr through the root logger, so musegl's own
loggers, the plugins', uvicorn's and Litestar's lines all look alike::

    2026-12-01 20:56:35,583 INFO    front musegl.serve: listening on http://127.0.0.1:8000 ...
    2026-12-01 20:56:43,526 INFO    worker musegl.worker: sessions: 4 slots ...

The third field says which process wrote the line. The front passes its
level to the worker in the worker's setup frame (:class:`musegl_core.worker.messages.Setup`).
"""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)-7s {role} %(name)s: %(message)s"


def configure(level: str, role: str) -> None:
    """Send every logger's records at ``level`` and above to stderr, in :data:`FORMAT`.

    Replaces whatever handlers the root logger had (a library that configured
    logging on import must not add a second format)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT.format(role=role)))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

"""Logging: one format for the front and the worker, at the level ``--log-level`` names.

Both processes write to stderr through the root logger, so musegl's own
loggers, the plugins', uvicorn's and Litestar's lines all look alike::

    2026-12-01 20:56:35,583 INFO    front musegl.serve: listening on http://127.0.0.1:8000 ...
    2026-12-01 20:56:43,526 INFO    worker musegl.worker: sessions: 4 slots ...

The third field says which process wrote the line. The front passes its
level to the worker in the worker's setup frame (:class:`musegl_core.worker.messages.Setup`).

Two bounds keep a hostile client from filling the disk through the log:

* **Length** (:class:`BoundedFormatter`): a line's message is cut after
  :data:`MAX_MESSAGE_CHARS` characters and a traceback after
  :data:`MAX_TRACEBACK_CHARS`, with the number of characters left out, so a
  client string quoted in a message (an error naming a 20 MiB value) costs a
  few KiB at most.
* **Repetition** (:class:`RepeatLimit`): the same line (logger, level, place
  in the code and message text alike) is written at most :data:`BURST` times in each
  :data:`WINDOW` seconds; the rest are counted, and the next line from that
  place after the window says how many were left out. asyncio's
  "socket.accept() out of system resource" with its traceback, logged in a
  loop while descriptors run out, becomes a few lines a minute.
"""

from __future__ import annotations

import logging
import sys
import time

#: the most characters of one record's message that are written
MAX_MESSAGE_CHARS = 4000
#: the most characters of one record's traceback that are written
MAX_TRACEBACK_CHARS = 16000
#: records from one place written per window, and the window in seconds
BURST, WINDOW = 20, 60.0


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters left out)"


class BoundedFormatter(logging.Formatter):
    """:data:`FORMAT` with the message and the traceback cut to their bounds."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _cut(record.message, MAX_MESSAGE_CHARS)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _cut(super().formatException(ei), MAX_TRACEBACK_CHARS)

    def formatStack(self, stack_info: str) -> str:
        return _cut(super().formatStack(stack_info), MAX_TRACEBACK_CHARS)


class RepeatLimit(logging.Filter):
    """At most ``burst`` alike records (logger, level, place, message text) in each
    ``window`` seconds; the first one after a window that dropped some says so."""

    def __init__(self, burst: int = BURST, window: float = WINDOW, clock=time.monotonic):
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self.places: dict[tuple, list] = {}  # place -> [window start, written, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a bad format: let the handler report it
            return True
        place = (record.name, record.levelno, record.pathname, record.lineno, text[:300], len(text))
        now = self.clock()
        seen = self.places.get(place)
        if seen is None or now - seen[0] >= self.window:
            dropped = seen[2] if seen is not None else 0
            if len(self.places) > 4096:  # many distinct places: forget the old ones
                self.places.clear()
            self.places[place] = [now, 1, 0]
            if dropped:
                record.msg, record.args = (f"{text} [{dropped} more like this left out of the log in the "
                                           f"last {self.window:g} s]"), None
            return True
        if seen[1] < self.burst:
            seen[1] += 1
            return True
        seen[2] += 1
        return False


LEVELS = ("debug", "info", "warning", "error")
FORMAT = "%(asctime)s %(levelname)-7s {role} %(name)s: %(message)s"


def configure(level: str, role: str) -> None:
    """Send every logger's records at ``level`` and above to stderr, in :data:`FORMAT`.

    Replaces whatever handlers the root logger had (a library that configured
    logging on import must not add a second format)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(BoundedFormatter(FORMAT.format(role=role)))
    handler.addFilter(RepeatLimit())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())

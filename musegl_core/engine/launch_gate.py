"""Lets the worker's other threads stand aside while the engine thread launches a step.

A step outside CUDA graphs (prefill, mixed) is hundreds of torch ops and kernel launches, each
of which gives up the GIL and takes it back; a preparation thread that holds the GIL meanwhile
makes every retake wait (docs/engine.md, "Sharing the GIL with the engine thread"). On an
executor that launches asynchronously (``ExecutorLimits.async_steps``: the device computes
while the host is free) the engine closes the gate for the launch only, a few milliseconds;
the preparation threads and the frame reader wait at the gate between their pieces of work
(each a millisecond or so) and go on while the device runs the step. They never wait longer
than :data:`MOST_WAIT` at a time, so a stuck launch cannot stop preparation. On an executor
that computes on the host the gate stays open (the step would hold it for its whole compute).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

#: The longest one wait at a closed gate lasts (seconds).
MOST_WAIT = 0.05


class LaunchGate:
    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.closed_count = 0

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Close the gate while the engine thread launches a step."""
        self._open.clear()
        self.closed_count += 1
        try:
            yield
        finally:
            self._open.set()

    def wait(self) -> None:
        """Called by the other threads between pieces of work: returns at once when the
        gate is open, else when it opens (at most :data:`MOST_WAIT` later)."""
        if not self._open.is_set():
            self._open.wait(MOST_WAIT)

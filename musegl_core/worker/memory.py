"""Giving the worker's freed memory back to the system once a burst of work is over.

glibc keeps the memory a process frees below the mmap threshold in its
arenas (musegl_core/allocator.py), and the worker, unlike the front
(musegl_core/http/memory.py), called no ``malloc_trim`` while it served. Under
the soak's mix its memory in use stayed flat while the free space its arenas
kept was 29.6 MiB at one run's warm point and 91.9 MiB at another's, for the
same memory in use (benchmarks/results/memory_growth_2026-12-07); the RSS
followed that free space, not what the worker held.

:class:`IdleTrim` runs ``malloc_trim(0)`` (:func:`~musegl_core.allocator.release_free_heap`)
when the engine is idle and has committed steps since the last trim, checked
every :data:`TRIM_PERIOD` seconds on a thread of its own: at most one trim per
period, none while the engine runs or when nothing ran. ``ctypes`` releases
the GIL for the call; an arriving request's allocations may wait for an
arena's lock while it runs.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("musegl.worker")

#: seconds between two checks (and so, at most one trim per this many seconds)
TRIM_PERIOD = 5.0


class IdleTrim:
    """``steps``: the engine's committed steps so far; ``idle``: whether it is idle now;
    ``release``: the trim (None: glibc's ``malloc_trim``, where there is one)."""

    def __init__(self, steps: Callable[[], int], idle: Callable[[], bool],
                 release: Callable[[], object] | None = None):
        if release is None:
            from musegl_core.allocator import release_free_heap

            release = release_free_heap
        self.steps, self.idle, self.release = steps, idle, release
        self._trimmed_at = steps()  # the step count at the last trim
        self.trims = 0

    def check(self) -> bool:
        """Trim now if the engine ran since the last trim and is idle; True when it trimmed."""
        steps = self.steps()
        if steps == self._trimmed_at or not self.idle():
            return False
        try:
            self.release()
        except Exception as exc:  # never stop the worker over it
            log.debug("malloc_trim failed: %s", exc)
        self._trimmed_at = steps
        self.trims += 1
        return True

    def run_forever(self, period: float = TRIM_PERIOD) -> None:
        while True:
            time.sleep(period)
            self.check()

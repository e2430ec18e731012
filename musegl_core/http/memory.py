"""Giving the front's freed memory back to the system after large requests.

A request body of several MiB (a 10 MiB ``/tokenize`` text, a 6 MiB prompt,
a large image) makes the front allocate a great deal for a short while: the
body, its parsed JSON, and for ``/tokenize`` the ``tokenizers`` library's
per-token strings, allocated in its own threads. glibc's allocator keeps
most of that memory once it is freed: each thread allocates in an arena of
its own, an arena gives back only the free space at its very end, and after
the first large block is freed the size from which blocks are mapped (and
unmapped when freed) rises to it, so the next bodies land in the arenas too.

Measured in the 2-minute soak (``benchmarks/soak.py``, tiny checkpoint,
6 clients): the front's RSS was about 610 MiB after the warm-up and climbed
(or fell) by tens of MiB with the mix of large bodies in flight, while the
memory it actually used stayed flat (Python objects under ``tracemalloc``,
and malloc's bytes in use, 43 MiB in the arenas); 390-400 MiB of the RSS
was free space held by the arenas. ``malloc_trim(0)`` returned it: 614 ->
236 MiB at the warm point, 236 MiB again at the end of the soak.

Some of that memory is not even freed when the response has gone out: a
400 for a wrongly typed field leaves the body in reference cycles, 20 MiB
for a 10 MiB body (the bytes and the parsed text), until the garbage
collector's next full pass, which may come much later. So a trim runs
``gc.collect()`` first, then ``malloc_trim(0)``.

:class:`MemoryTrim` trims in a thread after every request whose body had
at least :data:`TRIM_AFTER_BYTES` bytes (:class:`RequestLog
<musegl_core.http.request_log.RequestLog>` asks for it once the response has
gone out), at most once per :data:`TRIM_INTERVAL` seconds: requests that end
while a trim runs, or within the interval after it, cause one more trim at
the end of the interval, and the trims stop only after one that followed a
whole interval without such a request. So the last large request is always
followed by a trim at least an interval later, when what it still held
(its response in the transport's buffer, a cycle) is more likely freed:
with a single trim right after the request, the soak's front read 301 MiB
at the warm point instead of 236-243. A burst of large requests costs one
trim a second while it lasts, plus two; a trim takes a few tens of
milliseconds at these sizes. Where the C library has no ``malloc_trim``
(macOS, musl) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
from typing import Callable

log = logging.getLogger("musegl.http")

#: a request body at least this long is followed by a trim
TRIM_AFTER_BYTES = 1 << 20
#: seconds between two trims (at most one runs at a time)
TRIM_INTERVAL = 1.0


@functools.cache
def _libc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where there is none (looked up once)."""
    try:
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def collect_and_trim() -> int:
        gc.collect()  # a large body some reference cycle still holds: freed first, then given back
        return trim(0)

    return collect_and_trim


class MemoryTrim:
    """Coalesced, rate-limited ``malloc_trim`` runs on the event loop's default executor.

    ``trim`` replaces the C call (tests); None: the C library's, when it has one.
    """

    def __init__(self, trim: Callable[[], object] | None = None, *, interval: float = TRIM_INTERVAL,
                 min_bytes: int = TRIM_AFTER_BYTES):
        self._trim = trim if trim is not None else _libc_trim()
        self.interval = interval
        self.min_bytes = min_bytes
        self.runs = 0  # trims done
        self._task: asyncio.Task | None = None
        self._again = False

    @property
    def available(self) -> bool:
        return self._trim is not None

    def after_request(self, body_bytes: int) -> None:
        """A request with a body of ``body_bytes`` bytes ended (called on the event loop)."""
        if body_bytes >= self.min_bytes:
            self.request()

    def request(self) -> None:
        """Trim soon: now when no trim runs or waits, else once more after the current one."""
        if self._trim is None:
            return
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._again = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="musegl-malloc-trim")

    async def _run(self) -> None:
        assert self._trim is not None
        quiet = False  # no request asked during the interval before this trim
        while True:
            self._again = False
            try:
                await asyncio.to_thread(self._trim)
                self.runs += 1
            except Exception as exc:  # never fail a request over it
                log.debug("malloc_trim failed: %s", exc)
            await asyncio.sleep(self.interval)
            if quiet and not self._again:
                return
            quiet = not self._again

    async def idle(self) -> None:
        """Wait until no trim runs or waits (tests)."""
        while self._task is not None and not self._task.done():
            await asyncio.wait({self._task})

"""Grammar masks computed while the forward pass runs.

The scheduler plans a step on the engine thread; the masks of its sampled
rows depend only on ids already committed (the mask of a sequence's token at
step *t* reflects its tokens through *t - 1*, plus the drafts before the row),
so they can be computed while the executor runs the forward, which needs no
mask until it samples. :class:`MaskWorkers` is a small thread pool that does
that, one task per chunk (its rows in order, since a processor is stateful),
and :class:`PendingMasks` is what ``SeqChunk.masks`` then holds: a sequence
whose items wait for their task. llguidance drops the GIL while it computes
a mask (``LLMatcher.compute_bitmask``), and so do torch's kernels, so the two
overlap on the host as well.

Results are the same as computed inline: each processor still sees its
sequence's ids in order, one task at a time, and the engine waits for every
task of a step before it commits the step's tokens
(:meth:`PendingMasks.wait`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class MaskClock:
    """Seconds spent on masks: ``compute`` (all mask work, on any thread) and
    ``blocked`` (the engine thread computing masks inline, or waiting for a
    mask not ready yet: the part on the critical path). The worker exports
    both (``musegl_grammar_mask_seconds``, ``musegl_grammar_mask_blocked_seconds``)."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.blocked = 0.0
        self._lock = threading.Lock()

    def add(self, compute: float = 0.0, blocked: float = 0.0) -> None:
        with self._lock:
            self.compute += compute
            self.blocked += blocked


class PendingMasks(Sequence):
    """The masks of one chunk's sampled rows, computed by a worker thread.

    ``len`` is known at once; reading an item (or iterating) waits for the
    chunk's task. Executors should read masks after their forward pass, right
    before sampling, for the overlap to pay (``docs/executor.md`` 4)."""

    def __init__(self, future: Future, rows: int, clock: MaskClock):
        self._future = future
        self._rows = rows
        self._clock = clock

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index):
        self._block()
        return self._future.result()[index]

    def wait(self) -> None:
        """Block until the task ended (its error, if any, is raised by item access)."""
        self._block()

    def _block(self) -> None:
        if not self._future.done():
            started = time.perf_counter()
            self._future.exception()
            self._clock.add(blocked=time.perf_counter() - started)


class MaskWorkers:
    """Threads that compute grammar masks (``--grammar-threads``), started on first use."""

    def __init__(self, threads: int, clock: MaskClock):
        self.threads = threads
        self.clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, compute: Callable[[], list[Any]], rows: int) -> PendingMasks:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="masks")

        def timed() -> list[Any]:
            started = time.perf_counter()
            try:
                return compute()
            finally:
                self.clock.add(compute=time.perf_counter() - started)

        return PendingMasks(self._pool.submit(timed), rows, self.clock)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

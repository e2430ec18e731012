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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable


class PendingMasks(Sequence):
    """The masks of one chunk's sampled rows, computed by a worker thread.

    ``len`` is known at once; reading an item (or iterating) waits for the
    chunk's task. Executors should read masks after their forward pass, right
    before sampling, for the overlap to pay (``docs/executor.md`` 4)."""

    def __init__(self, future: Future, rows: int):
        self._future = future
        self._rows = rows

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, index):
        return self._future.result()[index]

    def wait(self) -> None:
        """Block until the task ended (its error, if any, is raised by item access)."""
        self._future.exception()


class MaskWorkers:
    """Threads that compute grammar masks (``--grammar-threads``), started on first use."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, compute: Callable[[], list[Any]], rows: int) -> PendingMasks:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="masks")
        return PendingMasks(self._pool.submit(compute), rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

"""A shared-memory ring between the engine's process and the ranks: one writer, N readers.

A message is pickled once, straight into a slot of one shared segment, and every
reader unpickles it from there (a step reaches N ranks with one serialization and
no pipe). A message larger than a slot goes into a segment of its own whose name
the slot carries; the last reader unlinks it. Semaphores order it: ``free`` counts
the slots no reader still needs, ``ready[r]`` the messages reader ``r`` has not
taken. Readers take messages in the order they were written.

Every wait polls ``alive`` (a callable) between short timeouts, so a peer that
died turns into :class:`PeerGone` instead of a wait forever. The processes share
one resource tracker (spawned children inherit it), which removes what is left
of the segments when the engine's process ends, however it ends.
"""

from __future__ import annotations

import pickle
import struct
from multiprocessing import shared_memory
from typing import Any, Callable

#: seconds between two looks at ``alive`` while waiting
POLL = 0.05
#: per slot: message number, payload bytes, readers still to read it, kind (0 inline, 1 own segment)
HEADER = struct.Struct("<qqii")
INLINE, OWN_SEGMENT = 0, 1


class PeerGone(RuntimeError):
    """The other side of the channel died (or ended) while we waited on it."""


class StepChannel:
    """``slots`` slots of ``slot_bytes`` in one segment; see the module docstring.
    Made in the parent (:meth:`create`), handed to the children as a process argument."""

    def __init__(self, name: str, slots: int, slot_bytes: int, readers: int, ready: list, free: Any,
                 lock: Any) -> None:
        self.name, self.slots, self.slot_bytes, self.readers = name, slots, slot_bytes, readers
        self.ready, self.free, self.lock = ready, free, lock
        self._segment: shared_memory.SharedMemory | None = None
        self.written = 0  # messages this process wrote (the writer's count)
        self.taken = 0  # messages this process read (a reader's count)
        self.owner = False

    @classmethod
    def create(cls, ctx, readers: int, slots: int = 8, slot_bytes: int = 1 << 20) -> "StepChannel":
        segment = shared_memory.SharedMemory(create=True, size=slots * (HEADER.size + slot_bytes))
        channel = cls(segment.name, slots, slot_bytes, readers, [ctx.Semaphore(0) for _ in range(readers)],
                      ctx.Semaphore(slots), ctx.Lock())
        channel._segment = segment
        channel.owner = True
        return channel

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_segment=None, written=0, taken=0, owner=False)
        return state

    @property
    def buf(self) -> memoryview:
        if self._segment is None:
            self._segment = shared_memory.SharedMemory(name=self.name)
        return self._segment.buf

    def _offset(self, number: int) -> int:
        return (number % self.slots) * (HEADER.size + self.slot_bytes)

    def write(self, message: Any, alive: Callable[[], bool]) -> None:
        """Put ``message`` in the next slot for every reader (waits for a free slot)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        _wait(self.free, alive)
        at = self._offset(self.written)
        buf = self.buf
        kind, payload = INLINE, data
        if len(data) > self.slot_bytes:
            own = shared_memory.SharedMemory(create=True, size=len(data))
            own.buf[:len(data)] = data
            kind, payload = OWN_SEGMENT, struct.pack("<q", len(data)) + own.name.encode()
            own.close()
        start = at + HEADER.size
        buf[start:start + len(payload)] = payload
        HEADER.pack_into(buf, at, self.written, len(payload), self.readers, kind)
        self.written += 1
        for ready in self.ready:
            ready.release()

    def read(self, reader: int, alive: Callable[[], bool], timeout: float | None = None) -> Any:
        """The next message for reader ``reader``; None when ``timeout`` seconds pass first."""
        if not _wait(self.ready[reader], alive, timeout):
            return None
        return self._take()

    def poll(self, reader: int) -> Any:
        """The next message for reader ``reader`` if one is there, else None (no wait)."""
        if not self.ready[reader].acquire(block=False):
            return None
        return self._take()

    def _take(self) -> Any:
        at = self._offset(self.taken)
        buf = self.buf
        number, length, _, kind = HEADER.unpack_from(buf, at)
        if number != self.taken:
            raise RuntimeError(f"channel out of step: slot holds message {number}, expected {self.taken}")
        self.taken += 1
        start = at + HEADER.size
        own = None
        if kind == INLINE:
            message = pickle.loads(buf[start:start + length])
        else:
            (size,) = struct.unpack_from("<q", buf, start)
            own = shared_memory.SharedMemory(name=bytes(buf[start + 8:start + length]).decode())
            message = pickle.loads(own.buf[:size])
        with self.lock:
            left = HEADER.unpack_from(buf, at)[2] - 1
            struct.pack_into("<i", buf, at + 16, left)
        if own is not None:
            own.close()
            if left == 0:
                own.unlink()
        if left == 0:
            self.free.release()
        return message

    def close(self) -> None:
        """Detach; the creator also removes the segment."""
        if self._segment is not None:
            self._segment.close()
            if self.owner:
                self._segment.unlink()
            self._segment = None


def _wait(semaphore: Any, alive: Callable[[], bool], timeout: float | None = None) -> bool:
    """Acquire ``semaphore``; :class:`PeerGone` once ``alive()`` is False; False after ``timeout``."""
    waited = 0.0
    while not semaphore.acquire(timeout=POLL):
        if not alive():
            raise PeerGone("the other side of the channel is gone")
        waited += POLL
        if timeout is not None and waited >= timeout:
            return False
    return True

"""A timeline of the worker: every engine step and every request's stages, as JSON lines.

``musegl serve --trace-steps FILE`` writes one line per event to ``FILE``
(appending), for finding where a request's time to first token goes:

* ``{"event": "received", "id": ...}``: the worker read the request's frame;
* ``"prepared"``: preparation (tokenizing, constraints, images) is done and
  the request went to the engine (``prompt_ids``: its ids);
* ``"admitted"``: the engine started it on a session (``cached``: positions
  its KV cache already held);
* ``"first_token"``: its prefill finished (the first token follows in the
  same step's output);
* ``"finished"``: it ended (``reason``);
* ``{"event": "gc", "generation": 0 | 1 | 2, "seconds": ..., "collected": ...}``: a
  garbage collection of the worker's process that took at least
  :data:`GC_MIN_SECONDS` (every thread waits for it);
* ``{"event": "step", "kind": "decode" | "prefill" | "mixed", "decode": rows,
  "prefill": rows, "seconds": ..., "running": ..., "prefilling": ...}``: a
  committed step (``seconds`` as the step book counts it: launch to result,
  or result to result for steps launched ahead), with the sequences running
  and those of them still prefilling when it was planned.

Every line has ``t`` (seconds since the trace opened, monotonic) and
``wall`` (Unix time), so it lines up with the front's request log. Lines are
written as they happen, from the engine thread and the preparation threads,
and flushed at once; tracing costs a few microseconds an event. Meant for
profiling runs, not for always-on logging: the file grows without bound.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path
from typing import IO, Any

__all__ = ["Trace"]

#: Garbage collections at least this long are traced.
GC_MIN_SECONDS = 0.001


class Trace:
    """Appends timeline events to a file (see the module docstring); thread-safe."""

    def __init__(self, stream: IO[str], clock=time.monotonic):
        self._stream = stream
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self._gc_started: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        started, self._gc_started = self._gc_started, None
        if started is None:
            return
        seconds = time.perf_counter() - started
        if seconds >= GC_MIN_SECONDS:
            self.event("gc", generation=info.get("generation"), seconds=round(seconds, 6),
                       collected=info.get("collected"))

    @classmethod
    def open(cls, path: str | Path) -> Trace:
        return cls(open(path, "a", encoding="utf-8", buffering=1))

    def event(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": round(self._clock() - self._start, 6), "wall": round(time.time(), 6),
                           "event": event, **fields}, separators=(",", ":"))
        with self._lock:
            if not self._stream.closed:
                self._stream.write(line + "\n")

    def request(self, stage: str, request_id: str, **fields: Any) -> None:
        """One stage of one request (``received``, ``prepared``, ``admitted``, ``first_token``, ``finished``)."""
        self.event(stage, id=request_id, **fields)

    def step(self, kind: str, decode: int, prefill: int, seconds: float, running: int, prefilling: int) -> None:
        """One committed step."""
        self.event("step", kind=kind, decode=decode, prefill=prefill, seconds=round(seconds, 6),
                   running=running, prefilling=prefilling)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        with self._lock:
            self._stream.close()

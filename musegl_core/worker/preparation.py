"""Request preparation off the control thread, in a bounded pool of two lanes.

The worker's control thread reads every frame (requests, cancellations,
stats), so it must never wait for one request's preparation: tokenizing a
long prompt, decoding and resizing a large image or compiling an output
constraint can take seconds. :class:`PreparationPool` runs preparations on a
few threads:

* the **light lane** takes text requests whose prompt and constraint are at
  most :data:`LIGHT_CHARS` characters;
* the **heavy lane** takes the rest (images, long text).

Each lane has a fixed number of threads, so preparation never takes more
than those; heavy requests queue behind each other, never in front of a
small one. The long steps release the GIL (``tokenizers`` batches of
pieces, pillow's decoder and resampler), so the engine thread and the other
lane keep running while a heavy request is prepared.

Hand-off rules:

* requests of one named session reach the engine in the order they arrived
  (one that is ready waits for the earlier ones of its session), as they did
  when the control thread prepared them one by one;
* a ``Cancel`` for a request still in preparation drops it: nothing of it
  reaches the engine;
* a failure fails that request alone: an :class:`ApiError` (bad input) as
  it is (``InputRefused``), anything else as ``PreparationFailed`` (a 500
  ``server_error``); the threads keep serving.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import attrs

from musegl_core.servable import one_line
from musegl_core.engine.errors import DuplicateId, EngineError
from musegl_core.engine.request import GenerateRequest, PreparedRequest
from musegl_core.engine.launch_gate import LaunchGate
from musegl_core.engine.trace import Trace
from musegl_core.errors import ApiError
from musegl_core.worker.messages import InputRefused, PreparationFailed

log = logging.getLogger("musegl.worker")

#: A text request up to this many characters (prompt text, token ids and
#: constraint text together) is prepared in the light lane.
LIGHT_CHARS = 1 << 16
#: Threads per lane. Heavy preparations are CPU-bound (decoding, resampling):
#: half the cores, 1 to 4, so they never crowd out the engine thread.
LIGHT_THREADS = 2
HEAVY_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))


def lane_of(request: GenerateRequest) -> str:
    """``"light"`` or ``"heavy"``: where ``request`` is prepared."""
    if request.images:
        return "heavy"
    size = sum(len(segment.text or "") + len(segment.token_ids or ()) for segment in request.prompt)
    size += len(request.grammar or "")
    if request.lazy_grammar is not None:
        size += sum(len(value) for value in attrs.astuple(request.lazy_grammar) if isinstance(value, str))
    return "light" if size <= LIGHT_CHARS else "heavy"


@attrs.define(eq=False)
class _Job:
    request: GenerateRequest
    lane: str
    done: bool = False
    cancelled: bool = False
    prepared: PreparedRequest | None = None
    error: EngineError | None = None


class PreparationPool:
    """Prepares requests on the lanes' threads and hands them on in order.

    :param prepare: request → prepared request (raises :class:`ApiError` for bad input).
    :param submit: called with each prepared request (the engine's ``submit``).
    :param fail: called with ``(request id, error kind)`` for a request that failed.
    :param trace: the worker's timeline (``--trace-steps``): a ``prepared`` event per request handed on.
    :param gate: the engine's :class:`LaunchGate`: each preparation waits at it before it starts.
    """

    def __init__(self, prepare: Callable[[GenerateRequest], PreparedRequest],
                 submit: Callable[[PreparedRequest], None], fail: Callable[[str, EngineError], None], *,
                 light_threads: int = LIGHT_THREADS, heavy_threads: int = HEAVY_THREADS, trace: Trace | None = None,
                 gate: LaunchGate | None = None):
        self._prepare = prepare
        self._trace = trace
        self._gate = gate
        self._submit = submit
        self._fail = fail
        self._lanes = {
            "light": ThreadPoolExecutor(light_threads, thread_name_prefix="musegl-prepare-light"),
            "heavy": ThreadPoolExecutor(heavy_threads, thread_name_prefix="musegl-prepare-heavy"),
        }
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}  # not handed on yet
        self._sessions: dict[str, collections.deque[_Job]] = {}  # per named session, in arrival order
        self._prepared = 0
        self._seconds = 0.0

    def submit(self, request: GenerateRequest) -> None:
        """Queue ``request`` for preparation (returns at once)."""
        job = _Job(request, lane_of(request))
        with self._lock:
            if request.id in self._jobs:
                duplicate = True
            else:
                duplicate = False
                self._jobs[request.id] = job
                if request.session_id is not None:
                    self._sessions.setdefault(request.session_id, collections.deque()).append(job)
        if duplicate:
            self._fail(request.id, DuplicateId(request.id))
            return
        self._lanes[job.lane].submit(self._run, job)

    def cancel(self, request_id: str) -> bool:
        """Drop a request still in preparation; False when it is not here (the
        engine has it, or it never came)."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return False
            job.cancelled = True
            return True

    def session_busy(self, session_id: str) -> bool:
        """Whether a request of ``session_id`` is still in preparation."""
        with self._lock:
            return session_id in self._sessions

    def stats(self) -> dict:
        """Counters for the worker's stats: requests in preparation (per lane),
        requests prepared and the seconds spent preparing them."""
        with self._lock:
            heavy = sum(1 for job in self._jobs.values() if job.lane == "heavy")
            return {
                "preparing": len(self._jobs),
                "preparing_heavy": heavy,
                "prepared": self._prepared,
                "prepare_seconds": self._seconds,
            }

    def close(self) -> None:
        """Stop: nothing queued is prepared any more, nothing more is handed on."""
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)

    # -- on the lanes' threads ------------------------------------------------------------
    def _run(self, job: _Job) -> None:
        if self._gate is not None:
            self._gate.wait()
        started = time.perf_counter()
        if not job.cancelled:
            try:
                job.prepared = self._prepare(job.request)
            except ApiError as err:
                job.error = InputRefused.of(err)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # a bug or a library's panic: this request's 500, never the worker's end
                log.error("preparing request %s failed", job.request.id, exc_info=True)
                job.error = PreparationFailed(one_line(exc))
        with self._lock:
            job.done = True
            self._prepared += 1
            self._seconds += time.perf_counter() - started
            self._hand_on(job)

    def _hand_on(self, job: _Job) -> None:
        """Pass on every job that is ready and first of its session (lock held;
        ``submit`` only enqueues for the engine thread)."""
        session = job.request.session_id
        if session is None:
            ready = [job]
        else:
            queue = self._sessions[session]
            ready = []
            while queue and queue[0].done:
                ready.append(queue.popleft())
            if not queue:
                del self._sessions[session]
        for item in ready:
            del self._jobs[item.request.id]
            if item.cancelled:
                continue
            try:
                if item.error is not None:
                    self._fail(item.request.id, item.error)
                else:
                    if self._trace is not None:
                        self._trace.request("prepared", item.request.id, lane=item.lane,
                                            prompt_ids=len(item.prepared.prompt_ids))
                    self._submit(item.prepared)
            except Exception:  # a broken pipe while writing: the worker is ending
                log.debug("handing on request %s failed", item.request.id, exc_info=True)

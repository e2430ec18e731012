"""The front's side of the worker: spawn, supervise, multiplex.

:class:`WorkerClient` starts ``musegl worker`` as a child process, talks JSON
lines over its stdin/stdout, routes events to the request that owns them, and
restarts the worker when it dies. Requests in flight when the worker dies fail
with 503 ``unavailable_error``; readiness is reported by :attr:`ready`.

Restart policy: a worker that exits before it ever became ready could not load
the model, and retrying would not help: the client gives up at once. After a
successful load, a dead worker is restarted after ``restart_delay`` seconds,
doubled for each consecutive failure (a worker that dies within
``stable_after`` seconds of becoming ready, or never becomes ready again),
up to ``max_restart_delay``; after ``max_failures`` consecutive failures the
client gives up. A ready worker that dies while generation requests are in
flight may have died of one of them, and nothing a client sends may end the
server: it is restarted after ``restart_delay`` and the death does not count
as a failure. Giving up logs one error line, sets :attr:`fatal` and calls
``on_fatal`` (``musegl serve`` then shuts down with exit status 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from typing import AsyncIterator, Callable

import attrs

from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError, shutting_down, unavailable
from musegl_core.worker.errors import api_error
from musegl_core.worker import messages as m

log = logging.getLogger("musegl.front")

#: environment variables the worker is started without (secrets it does not need)
SECRET_ENV = ("MUSEGL_API_KEY",)


def worker_command() -> list[str]:
    """The argv that starts a worker: no settings in it (they come over stdin, see :class:`m.Setup`)."""
    return [sys.executable, "-m", "musegl_core.worker.main"]


def worker_setup(config: ServeConfig, log_level: str = "info") -> m.Setup:
    """The first frame a worker for ``config`` reads: the settings without the API key,
    which only the front checks."""
    return m.Setup(attrs.evolve(config, api_key=None), log_level)


def worker_env() -> dict[str, str]:
    """The worker's environment: the front's, without :data:`SECRET_ENV`."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def send_signal(proc: asyncio.subprocess.Process, sig: int) -> None:
    """Send ``sig`` to the worker ``proc`` unless it has been reaped, without reaping it.

    ``Process.terminate()``/``kill()`` go through ``subprocess.Popen.send_signal``, which
    first polls the child (``waitpid(WNOHANG)``). When the worker had just exited (it stops
    on EOF on its stdin, which shutdown closes right before), that poll reaped it ahead of
    asyncio's child watcher, whose own ``waitpid`` then failed: "Unknown child process pid
    N, will report returncode 255" at shutdown (2 of 11 SIGINTs), and a wrong exit status.
    Here the watcher stays the only reaper: a pidfd (Linux) names the process even as a
    zombie and fails once it is reaped; elsewhere the pid is signalled directly (a zombie
    takes signals; once the watcher has reaped it, ``returncode`` is set, checked first)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError) as exc:  # not Linux 5.3+ (macOS), or no such process
            if isinstance(exc, ProcessLookupError):
                return
            os.kill(proc.pid, sig)
            return
        try:
            signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)


class WorkerClient:
    """Supervises one worker process and multiplexes requests over its pipes."""

    def __init__(self, config: ServeConfig, *, restart_delay: float = 0.5, max_restart_delay: float = 30.0,
                 max_failures: int = 5, stable_after: float = 60.0,
                 on_fatal: Callable[[str], None] | None = None, log_level: str = "info"):
        self.config = config
        self.log_level = log_level  # the worker logs at the front's level
        self.restart_delay = restart_delay
        self.max_restart_delay = max_restart_delay
        self.max_failures = max_failures
        self.stable_after = stable_after
        self.on_fatal = on_fatal
        self.fatal: str | None = None  # why the client gave up on the worker
        self.failures = 0  # consecutive failed starts
        self.info: m.Ready | None = None
        self.restarts = 0
        self._ready_at: float | None = None  # when the current worker became ready
        self._spawned_at: float | None = None  # when the current worker was started (or will be, after a delay)
        self._load_seconds: float | None = None  # how long the last successful start took, until Ready
        self._proc: asyncio.subprocess.Process | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._generating: dict[str, int] = {}  # generation request id -> pid of the worker it was sent to
        self._write_lock = asyncio.Lock()
        self._ready = asyncio.Event()
        self._supervisor: asyncio.Task | None = None
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start supervising; the worker loads in the background."""
        self._supervisor = asyncio.create_task(self._supervise(), name="musegl-worker-supervisor")

    async def wait_ready(self, timeout: float | None = None) -> m.Ready:
        await asyncio.wait_for(self._ready.wait(), timeout)
        assert self.info is not None
        return self.info

    async def close(self) -> None:
        self._closing = True
        await self._stop_process()
        if self._supervisor:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._supervisor
        await self._stop_process()

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc and proc.returncode is None:
            if proc.stdin is not None:  # EOF on stdin is the worker's signal to stop
                with contextlib.suppress(Exception):
                    proc.stdin.close()
            send_signal(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                send_signal(proc, signal.SIGKILL)
                await proc.wait()

    async def _supervise(self) -> None:
        while not self._closing:
            self._ready_at = None
            self._spawned_at = time.monotonic()
            self._proc = await asyncio.create_subprocess_exec(
                *worker_command(),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=m.MAX_EVENT_FRAME + 1,
                env=worker_env(),
                # Its own session: a Ctrl-C in the terminal (SIGINT to the process group)
                # reaches only the front, which stops the worker last, on its own terms.
                start_new_session=True,
            )
            log.info("worker started (pid %d)", self._proc.pid)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a worker dead at once: read below
                assert self._proc.stdin is not None
                self._proc.stdin.write(m.encode(worker_setup(self.config, self.log_level)))
                await self._proc.stdin.drain()
            try:
                await self._read_events(self._proc)
            finally:
                # The pipe closed: the worker is gone (or going). Fail its requests
                # at once; reaping the process must not delay that.
                serving = self._generations_on(self._proc.pid)
                self._ready.clear()
                self._fail_all(
                    shutting_down()
                    if self._closing
                    else unavailable("the model worker stopped; it is restarting", code="worker_restarting")
                )
                if self._closing:
                    await self._stop_process()
            if self._closing:
                return
            code = await self._reap(self._proc)
            delay = self._next_delay(code, serving)
            if delay is None:
                return
            self.restarts += 1
            if serving:
                log.error("worker exited with status %s while serving %d request(s); restarting in %.1f s "
                          "(not counted toward giving up: a request may have caused it)", code, serving, delay)
            else:
                log.error("worker exited with status %s; restarting in %.1f s (consecutive failures: %d of %d)",
                          code, delay, self.failures, self.max_failures)
            self._spawned_at = time.monotonic() + delay
            await asyncio.sleep(delay)

    def _generations_on(self, pid: int) -> int:
        """Generation requests sent to worker ``pid`` and not finished."""
        return sum(1 for sent_to in self._generating.values() if sent_to == pid)

    def _next_delay(self, code: int | None, serving: int = 0) -> float | None:
        """Seconds to wait before restarting a worker that exited with ``code``
        while ``serving`` generation requests were in flight; None when the
        client gives up (see the module docstring)."""
        if self.info is None:  # no worker has ever loaded the model
            self._give_up(f"the model worker exited with status {code} before it finished loading "
                          f"{self.config.model!r} (its error is above); not restarting")
            return None
        if serving and self._ready_at is not None:
            # A ready worker that died while generating may have died of a request (input
            # no check caught). Whatever clients send must never end the server, so such a
            # death is restarted without counting toward giving up.
            return self.restart_delay
        stable = self._ready_at is not None and time.monotonic() - self._ready_at >= self.stable_after
        self.failures = 1 if stable else self.failures + 1
        if self.failures > self.max_failures:
            self._give_up(f"the model worker failed {self.max_failures} times in a row (last exit status {code}); "
                          "giving up")
            return None
        return min(self.max_restart_delay, self.restart_delay * 2 ** (self.failures - 1))

    def _give_up(self, reason: str) -> None:
        self.fatal = reason
        log.error("%s", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    @staticmethod
    async def _reap(proc: asyncio.subprocess.Process) -> int | None:
        """Wait for a worker whose pipe closed; kill it if it lingers."""
        try:
            return await asyncio.wait_for(proc.wait(), 5)
        except asyncio.TimeoutError:
            send_signal(proc, signal.SIGKILL)
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(proc.wait(), 5)
            return proc.returncode

    async def _read_events(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            try:
                line = await proc.stdout.readline()
            except ValueError:  # a frame over the 1 MiB limit: the worker is broken
                log.error("worker sent a frame over %d bytes; restarting it", m.MAX_EVENT_FRAME)
                send_signal(proc, signal.SIGKILL)
                return
            if not line:
                (log.info if self._closing else log.warning)("worker pipe closed (pid %d)", proc.pid)
                return
            self._deliver(line)

    def _deliver(self, line: bytes) -> None:
        """Route one event frame from the worker to its request's queue. A frame that names
        a request but cannot be read fails that request (:class:`~musegl_core.worker.messages.BadEvent`;
        leaving its stream cancels it in the worker) instead of losing its output."""
        try:
            event = m.decode(line)
        except m.FrameError as exc:
            log.error("bad frame from worker: %s", exc)
            if exc.id is None or exc.id not in self._queues:
                return
            event = m.Failed(exc.id, m.BadEvent(str(exc)))
        if isinstance(event, m.Ready):
            self.info = event
            self._ready_at = time.monotonic()
            if self._spawned_at is not None:
                self._load_seconds = self._ready_at - self._spawned_at
            self._ready.set()
            log.info("worker ready: %s", event.model.name)
            return
        queue = self._queues.get(getattr(event, "id", None) or "")
        if queue is not None:
            queue.put_nowait(event)
        elif isinstance(event, m.Failed) and event.id is None:
            log.error("worker error: %s", api_error(event.error).message)

    def retry_after(self) -> int | None:
        """Seconds until the worker should be ready, for the ``Retry-After`` of a 503 that
        says it is not: the last start's duration (spawn to Ready) less what this start has
        run, plus a restart delay still pending; at least 1. None when nothing is known
        (no start has finished yet: the first load's length depends on the model) or when
        the worker is ready."""
        if self.ready or self._load_seconds is None or self._spawned_at is None:
            return None
        return max(1, math.ceil(self._spawned_at + self._load_seconds - time.monotonic()))

    def begin_shutdown(self) -> None:
        """The server is shutting down: a worker that exits from now on (a
        service manager may signal it too) is not restarted, and its requests
        fail with ``server_shutting_down`` rather than ``worker_restarting``."""
        self._closing = True

    def fail_inflight(self, error: ApiError) -> None:
        """End every request in flight with ``error`` (shutdown's deadline passed)."""
        self._fail_all(error)

    def _fail_all(self, error: ApiError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)

    # -- requests ----------------------------------------------------------------------
    async def _send(self, message: m.Request) -> None:
        line = m.encode(message)
        if len(line) > self.config.max_request_bytes:
            raise ApiError(
                413,
                f"the request needs a {len(line)}-byte worker frame, over --max-request-bytes "
                f"({self.config.max_request_bytes})",
                "invalid_request_error",
                "request_too_large",
            )
        proc = self._proc
        if not self.ready or proc is None or proc.stdin is None:
            raise unavailable("the model worker is not ready", code="worker_unavailable")
        async with self._write_lock:
            try:
                proc.stdin.write(line)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise unavailable("the model worker stopped", code="worker_restarting") from exc

    async def _ask(self, kind: str, make, timeout: float):
        """Send the control message ``make(rid)``; return its one answer (or raise
        the :class:`ApiError` it failed with)."""
        rid = f"{kind}-{os.urandom(6).hex()}"
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        try:
            await self._send(make(rid))
            item = await asyncio.wait_for(queue.get(), timeout)
        finally:
            self._queues.pop(rid, None)
        if isinstance(item, ApiError):
            raise item
        if isinstance(item, m.Failed):
            raise api_error(item.error)
        return item

    async def stats(self, timeout: float = 10) -> dict:
        """The engine's counters (KV blocks, sessions, steps), read between steps."""
        return dict((await self._ask("stats", m.Stats, timeout)).values)

    async def list_sessions(self, timeout: float = 10) -> tuple:
        """The named sessions (:class:`~musegl_core.engine.sessions.SessionInfo`), most recent first."""
        return (await self._ask("sessions", m.ListSessions, timeout)).sessions

    async def close_session(self, session_id: str, timeout: float = 10) -> None:
        """Close an idle named session; ApiError 404 (unknown) or 409 (active)."""
        await self._ask("close", lambda rid: m.CloseSession(rid, session_id), timeout)

    @contextlib.asynccontextmanager
    async def generate(self, request: m.Generate) -> AsyncIterator[AsyncIterator[m.Event]]:
        """Submit ``request``; yields an async iterator of its events.

        The iterator yields :class:`Started`, then :class:`Tokens` events, and
        ends after :class:`Done`. A :class:`Failed` event or a worker death
        raises :class:`ApiError`. Leaving the context before ``Done`` (client
        disconnect, error) cancels the request in the worker.
        """
        if request.id in self._queues:
            raise ValueError(f"duplicate request id {request.id}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.id] = queue
        finished = False

        async def events() -> AsyncIterator[m.Event]:
            nonlocal finished
            while True:
                item = await queue.get()
                if isinstance(item, ApiError):
                    finished = True
                    raise item
                if isinstance(item, m.Failed):
                    # the worker ended the request, unless the front failed it (it still runs there)
                    finished = not isinstance(item.error, m.BadEvent)
                    raise api_error(item.error)
                yield item
                if isinstance(item, m.Done):
                    finished = True
                    return

        try:
            await self._send(request)
            if self._proc is not None:
                self._generating[request.id] = self._proc.pid
            yield events()
        finally:
            self._queues.pop(request.id, None)
            self._generating.pop(request.id, None)
            if not finished and self.ready:
                with contextlib.suppress(ApiError):
                    await self._send(m.Cancel(request.id))

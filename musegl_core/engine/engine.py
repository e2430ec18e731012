"""The engine loop: admits prepared requests, runs executor steps, emits events.

One engine thread owns the executor. Other threads talk to it only through
:meth:`Engine.submit` and :meth:`Engine.cancel`, which enqueue commands; the
loop applies them between steps, so a cancellation takes effect within one
step. Events (:mod:`musegl_core.worker.messages`) go to the ``emit`` callback.

Every request runs on a session (:mod:`musegl_core.engine.sessions`): its
named session, or a temporary one for an anonymous request. Requests on the
same named session run one after another; the next one reuses the KV of the
longest common prefix of its prompt with the session's transcript (or with a
snapshot), always executing at least one fresh prompt position.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

import attrs

from musegl_core.engine.detokenize import IncrementalDetokenizer
from musegl_core.engine.executor import Executor
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.replay import ReplayLog, Replayer
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.sessions import CapacityError, Session, SessionBusy, SessionTable
from musegl_core.engine.stops import StopMatcher
from musegl_core.errors import ApiError
from musegl_core.worker import messages as m

log = logging.getLogger("musegl.engine")


@attrs.frozen
class EngineConfig:
    max_context: int = 8192
    max_sessions: int = 4
    max_inflight_requests: int = 4
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    prefix_cache_entries: int = 0
    evict_idle_sessions: bool = False
    kv_blocks: int | None = None
    prefix_caching: bool = True
    session_idle_timeout: float | None = None

    @classmethod
    def from_serve(cls, config) -> "EngineConfig":
        """The engine's part of a :class:`~musegl_core.config.ServeConfig`."""
        return cls(**{field.name: getattr(config, field.name) for field in attrs.fields(cls)})

    def pool_blocks(self, block_size: int) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        return SessionTable.pool_blocks(
            block_size,
            max_sessions=self.max_sessions,
            max_context=self.max_context,
            snapshots=self.prefix_cache_entries,
        )


def context_error(prompt_tokens: int, reservation: int, max_context: int, source: str = "worker") -> ApiError:
    """400 ``context_length_exceeded`` with the counts a client needs to compact."""
    budget = max_context - reservation
    return ApiError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, you requested "
        f"{prompt_tokens + reservation} tokens ({prompt_tokens} in the messages, {reservation} in the "
        f"completion). Please reduce the length of the messages or completion.",
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
        metadata={
            "context_length": max_context,
            "prompt_tokens": prompt_tokens,
            "max_prompt_tokens": budget,
            "completion_reservation": reservation,
            "source": source,
        },
    )


def busy_error() -> ApiError:
    return ApiError(503, "the server is busy (--max-inflight-requests reached); retry shortly",
                    "unavailable_error", "server_busy", retry_after=1)


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer,
        config: EngineConfig,
        emit: Callable[[object], None],
    ):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.emit = emit
        block_size = executor.block_size
        self.pool = KVPool(config.pool_blocks(block_size), block_size)
        executor.allocate_kv(self.pool.num_blocks)
        self.sessions = SessionTable(
            self.pool,
            max_sessions=config.max_sessions,
            max_context=config.max_context,
            snapshots=config.prefix_cache_entries,
            evict_idle=config.evict_idle_sessions,
            prefix_caching=config.prefix_caching,
            idle_timeout=config.session_idle_timeout,
        )
        max_step = min(executor.limits.max_step_tokens, config.max_decode_sequences + config.max_prefill_chunk)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerLimits(config.max_decode_sequences, config.max_prefill_chunk, max_step),
        )
        self.end_ids = frozenset(tokenizer.end_of_generation_ids)
        self.replayer = Replayer(tokenizer, self.end_ids)
        self._inbox: queue.Queue = queue.Queue()
        self._running: dict[str, SequenceState] = {}
        self._waiting: dict[str, tuple[PreparedRequest, Session]] = {}
        self._next_handle = 0
        self._stopping = False
        self.steps = 0

    # -- thread-safe commands ---------------------------------------------------------
    def submit(self, request: PreparedRequest) -> None:
        self._inbox.put(("submit", request))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def stop(self) -> None:
        self._inbox.put(("stop", None))

    def list_sessions(self, reply: Callable[[list], None]) -> None:
        """``reply(infos)`` on the engine thread: every named session (``GET /v1/sessions``)."""
        self._inbox.put(("sessions", reply))

    def close_session(self, name: str, reply: Callable[[ApiError | None], None]) -> None:
        """Close an idle named session; ``reply(None)`` or ``reply(error)`` (404, 409)."""
        self._inbox.put(("close_session", (name, reply)))

    def expire_idle_sessions(self) -> None:
        """Apply ``--session-idle-timeout`` now (the worker calls this every second)."""
        self._inbox.put(("expire", None))

    def stats(self) -> dict:
        """Pool and session counters (read by the worker between steps)."""
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.used_blocks,
            "kv_blocks_reserved": self.pool.reserved_blocks,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "steps": self.steps,
            **self.sessions.stats(),
        }

    # -- loop ------------------------------------------------------------------------
    def run_forever(self) -> None:
        while not self._stopping:
            self._drain(block=self.scheduler.idle)
            if not self.scheduler.idle:
                self.step()

    def run_until_idle(self) -> None:
        """Run until every submitted request has finished (tools and tests)."""
        while True:
            self._drain(block=False)
            if self.scheduler.idle:
                return
            self.step()

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "submit":
                self._admit(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "call":
                arg(self.stats())
            elif kind == "sessions":
                self.sessions.expire_idle()
                arg(self.sessions.describe())
            elif kind == "close_session":
                self._close_session(*arg)
            elif kind == "expire":
                self.sessions.expire_idle()
            elif kind == "stop":
                self._stopping = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def call(self, function: Callable[[dict], None]) -> None:
        """Run ``function(stats)`` on the engine thread between steps."""
        self._inbox.put(("call", function))

    def _close_session(self, name: str, reply: Callable[[ApiError | None], None]) -> None:
        try:
            self.sessions.close(name)
        except KeyError:
            reply(ApiError(404, f"no session {name!r}", "not_found_error", "session_not_found", "session_id"))
        except SessionBusy:
            reply(ApiError(409, f"session {name!r} has a request running or queued; close it when idle",
                           "invalid_request_error", "session_active", "session_id"))
        else:
            reply(None)

    # -- admission -------------------------------------------------------------------
    def _fail(self, request_id: str, error: ApiError) -> None:
        self.emit(
            m.Failed(request_id, error.status, error.message, error.type, error.code, error.param, dict(error.metadata))
        )

    def _admit(self, request: PreparedRequest) -> None:
        config = self.config
        if request.id in self._running or request.id in self._waiting:
            self._fail(request.id, ApiError(400, f"duplicate request id {request.id}"))
            return
        prompt = len(request.prompt_ids)
        reservation = request.max_tokens or 1
        if prompt + reservation > config.max_context:
            self._fail(request.id, context_error(prompt, reservation, config.max_context))
            return
        if len(self._running) + len(self._waiting) >= config.max_inflight_requests:
            self._fail(request.id, busy_error())  # queue overload never evicts a session
            return
        self._place(request)

    def _place(self, request: PreparedRequest) -> None:
        """Run ``request`` on its session now, or queue it behind the session's active one."""
        try:
            session, _created = self.sessions.open(request.session_id)
        except CapacityError as exc:
            self._fail(request.id, ApiError(503, f"no session slot is free: {exc}", "unavailable_error",
                                            "session_capacity", retry_after=1))
            return
        if session.active:  # one request at a time per session; the next waits its turn
            session.waiting.append(request)
            self._waiting[request.id] = (request, session)
            return
        self._start(request, session)

    def _start(self, request: PreparedRequest, session: Session) -> None:
        session.active = True
        session.last_used = time.monotonic()
        prompt = list(request.prompt_ids)
        if session.name is not None and session.clean:
            replayed, kept = self.replayer.apply(session.replay, prompt)
            if len(replayed) + (request.max_tokens or 1) <= self.config.max_context:
                prompt = replayed
                session.replay.turns = kept
        reused = self.sessions.attach(session, prompt)  # a dirty session reuses nothing
        session.clean = True  # its cache now holds exactly ``prompt[:reused]``
        max_new = min(request.max_tokens or self.config.max_context, self.config.max_context - len(prompt))
        seq = SequenceState(
            request=request,
            handle=self._next_handle,
            max_new=max_new,
            tokens=prompt,
            prompt_len=len(prompt),
            session=session,
            computed=reused,
            cached=reused,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopMatcher(request.stop, request.template_stops),
        )
        self._next_handle += 1
        self._running[request.id] = seq
        self.scheduler.add(seq)

    def _cancel(self, request_id: str) -> None:
        seq = self._running.get(request_id)
        if seq is not None:
            self._finish(seq, "cancelled", None)
            return
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            request, session = waiting
            session.waiting.remove(request)
            self._release_if_unused(session)

    # -- one forward -----------------------------------------------------------------
    def step(self) -> None:
        planned = self.scheduler.schedule()
        if planned is None:
            return
        step, plan, copies = planned
        try:
            if copies:
                self.executor.copy_blocks(copies)
            output = self.executor.step(step)
        except Exception as exc:  # an executor failure fails this batch, not the worker
            log.exception("executor step failed")
            for seq, _ in plan:
                self._finish(seq, None, None)
                self._fail(seq.id, ApiError(500, f"model execution failed: {exc}", "server_error"))
            return
        self.steps += 1
        for seq, rows in plan:
            seq.computed += rows
            if seq.handle not in output.tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            if seq.phase is Phase.PREFILL:
                seq.phase = Phase.DECODE
                self._prefilled(seq)
            self._on_token(seq, output.tokens[seq.handle])

    def _prefilled(self, seq: SequenceState) -> None:
        session = seq.session
        session.tokens = seq.tokens[: seq.computed]
        self.sessions.publish(session)
        self.sessions.snapshot(session)
        self.emit(m.Started(seq.id, seq.prompt_len, seq.cached))

    def _on_token(self, seq: SequenceState, token: int) -> None:
        request = seq.request
        if request.stream:
            seq.session.confirmed = True  # first raw output confirms a streamed session
        seq.generated.append(token)
        seq.tokens.append(token)
        eos = token in self.end_ids and not request.ignore_eos
        text, matched = seq.stops.push("" if eos else seq.detokenizer.push(token))
        at_end = eos or len(seq.generated) >= seq.max_new
        if matched is None and at_end:
            # End of generation: release held bytes and held stop prefixes.
            tail, matched = seq.stops.push(seq.detokenizer.flush())
            text += tail
            if matched is None:
                text += seq.stops.flush()
                matched = seq.stops.matched
        seq.unreported.append(token)
        if text:
            self.emit(m.Tokens(seq.id, tuple(seq.unreported), text))
            seq.unreported.clear()
        if matched is not None:
            self._finish(seq, "stop", matched)
        elif eos:
            self._finish(seq, "stop", None)
        elif at_end:
            self._finish(seq, "length", None)

    def _finish(self, seq: SequenceState, reason: str | None, matched_stop: str | None) -> None:
        """End ``seq``: ``reason`` None means it failed (the caller reports why)."""
        if seq.phase is Phase.FINISHED:
            return
        seq.phase = Phase.FINISHED
        self.scheduler.remove(seq)
        self.executor.release_sequence(seq.handle)
        self._running.pop(seq.id, None)
        session = seq.session
        # Positions with K/V in the cache: the prompt and every generated token but the last.
        session.tokens = seq.tokens[: seq.computed]
        if reason is not None:  # not after an executor failure
            self.sessions.publish(session)
        success = reason in ("stop", "length")
        if success:
            session.confirmed = True
            if matched_stop is None:  # a stop-trimmed answer cannot be matched to its ids
                executed = tuple(seq.tokens[: seq.prompt_len])
                turns = [t for t in session.replay.turns if t[0] < seq.prompt_len]
                turns.append((seq.prompt_len, self.replayer.turn_ids(seq.generated)))
                session.replay = ReplayLog(executed, turns)
            else:
                session.replay = ReplayLog()
        else:
            session.clean = False  # an interrupted turn replays from scratch
            session.replay = ReplayLog()
        session.active = False
        session.last_used = time.monotonic()
        if session.name is None or not session.confirmed:
            self._drop_session(session)
        elif session.waiting:
            next_request = session.waiting.popleft()
            del self._waiting[next_request.id]
            self._start(next_request, session)
        if reason is not None:
            self.emit(
                m.Done(
                    seq.id,
                    reason,
                    matched_stop,
                    seq.prompt_len,
                    len(seq.generated),
                    seq.cached,
                    None if matched_stop is not None else tuple(seq.generated),
                )
            )

    def _drop_session(self, session: Session) -> None:
        """Close a temporary or unconfirmed session; queued requests get a fresh one."""
        waiting = list(session.waiting)
        session.waiting.clear()
        self.sessions.drop(session)
        for request in waiting:
            del self._waiting[request.id]
            self._place(request)

    def _release_if_unused(self, session: Session) -> None:
        if session.idle and (session.name is None or not session.confirmed):
            self._drop_session(session)

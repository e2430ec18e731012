"""The engine loop: admits prepared requests, runs executor steps, emits events.

One engine thread owns the executor. Other threads talk to it only through
:meth:`Engine.submit` and :meth:`Engine.cancel`, which enqueue commands
(:mod:`musegl_core.engine.commands`); the loop applies them between steps, so a
cancellation takes effect within one step. Events
(:mod:`musegl_core.engine.events`) go to the ``emit`` callback.

Every request runs on a session (:mod:`musegl_core.engine.sessions`): its
named session, or a temporary one for an anonymous request. Requests on the
same named session run one after another; the next one reuses the KV of the
longest common prefix of its prompt with the session's transcript (or with a
snapshot), always executing at least one fresh prompt position.

A step commits 0..k+1 tokens per sequence: a decoding sequence may carry
draft tokens from a speculator (:mod:`musegl_core.engine.speculator`); the
engine keeps the sampled tokens the drafts agree with, rolls its length back
past the rest, and feeds the committed tokens one by one through stops,
``max_tokens``, detokenization and session bookkeeping, exactly as if they
had been decoded one per step.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

import attrs

from musegl_core.engine import commands, errors
from musegl_core.engine import events as ev
from musegl_core.engine.admission import Admission
from musegl_core.engine.detokenize import IncrementalDetokenizer, hidden_ids
from musegl_core.engine.executor import Executor, ExecutorLimits, PendingStep, Step, TokenLogprobs
from musegl_core.engine.identity import prompt_keys, split_keys
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.kv_sizing import plan_pool
from musegl_core.engine.prefill_budget import PrefillBudget
from musegl_core.engine.randomness import random_seed
from musegl_core.engine.replay import ReplayLog, ReplayPlan, Replayer
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.masks import PendingMasks
from musegl_core.engine.output import push_token
from musegl_core.engine.scheduler import ScheduledStep, Scheduler, SchedulerLimits
from musegl_core.engine.errors import constraint_failure, context_error  # noqa: F401 (importable from here too)
from musegl_core.engine.sessions import Session, SessionBusy, SessionTable
from musegl_core.engine.speculator import DeviceDrafts, DraftRequest, NoSpeculator, Speculator, proposes_on_device
from musegl_core.engine.step_book import StepBook
from musegl_core.engine.stops import StopMatcher
from musegl_core.engine.throughput import ThroughputLog
from musegl_core.errors import ApiError

log = logging.getLogger("musegl.engine")


@attrs.frozen
class EngineConfig:
    max_context: int = 8192
    max_sessions: int = 4
    max_inflight_requests: int = 4
    max_queued_requests: int = 1024
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    prefix_cache_entries: int = 0
    evict_idle_sessions: bool = False
    kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.9
    prefix_caching: bool = True
    session_idle_timeout: float | None = None
    soft_session_idle_timeout: float = 600.0
    grammar_threads: int | None = None  # None: 0 for an executor on the host CPU, else 2
    prefill_stall_factor: float = 6.0
    throughput_log_interval: float = 10.0  # seconds between throughput lines while busy (0: none)

    @classmethod
    def from_serve(cls, config) -> "EngineConfig":
        """The engine's part of a :class:`~musegl_core.config.ServeConfig`."""
        return cls(**{field.name: getattr(config, field.name) for field in attrs.fields(cls)})

    def needed_blocks(self, block_size: int) -> int:
        """Blocks every session slot and snapshot needs to fill its budget."""
        return SessionTable.pool_blocks(
            block_size,
            max_sessions=self.max_sessions,
            max_context=self.max_context,
            snapshots=self.prefix_cache_entries,
        )


@attrs.define
class InFlight:
    """A step launched on an asynchronous executor, not committed yet."""

    scheduled: ScheduledStep
    pending: PendingStep
    started: float


def grammar_threads(configured: int | None, limits: ExecutorLimits) -> int:
    """Mask threads: as configured, else none when the forward runs on the host CPU (measured on
    2 cores: overlapping threads cost constrained decoding 5-9 %, masks between steps under 1 %)
    and 2 otherwise (a GPU forward leaves the cores idle)."""
    if configured is not None:
        return configured
    return 0 if limits.host_compute else 2


class Engine:
    def __init__(
        self,
        executor: Executor,
        tokenizer,
        config: EngineConfig,
        emit: Callable[[object], None],
        speculator: Speculator | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.emit = emit
        self.speculator = speculator or NoSpeculator()
        self.clock = clock
        block_size = executor.block_size
        self.pool = KVPool(plan_pool(config, executor, self.speculator), block_size)
        expect_taps = getattr(executor, "expect_taps", None)  # optional (docs/executor.md section 8)
        if self.speculator.taps and callable(expect_taps):
            expect_taps(tuple(self.speculator.taps))
        executor.allocate_kv(self.pool.num_blocks)
        self.speculator.allocate_kv(self.pool.num_blocks)
        self.sessions = SessionTable(
            self.pool,
            max_sessions=config.max_sessions,
            max_context=config.max_context,
            snapshots=config.prefix_cache_entries,
            evict_idle=config.evict_idle_sessions,
            prefix_caching=config.prefix_caching,
            idle_timeout=config.session_idle_timeout,
            soft_idle_timeout=config.soft_session_idle_timeout,
        )
        limits = executor.limits
        drafts = config.max_decode_sequences * self.speculator.max_draft
        max_step = min(limits.max_step_tokens, config.max_decode_sequences + drafts + config.max_prefill_chunk)
        self.prefill_budget = PrefillBudget(config.prefill_stall_factor, config.max_prefill_chunk)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerLimits(config.max_decode_sequences, config.max_prefill_chunk, max_step, tuple(limits.step_sizes)),
            embed=self._embedding,
            taps=tuple(self.speculator.taps),
            mask_threads=grammar_threads(config.grammar_threads, limits),
            budget=self.prefill_budget,
        )
        self.end_ids = frozenset(tokenizer.end_of_generation_ids)
        self.replayer = Replayer(tokenizer, self.end_ids)
        self._inbox: queue.Queue = queue.Queue()
        self.admission = Admission(config, self.sessions, self.replayer, self.scheduler.by_id, self._start,
                                   self._fail)
        self._queue_seconds: dict[str, float] = {}  # how long each running request waited, until Started
        self.throughput = ThroughputLog(config.throughput_log_interval)
        self._next_handle = 0
        self._stopping = False
        self.steps = 0
        self.step_book = StepBook()
        self.steps_ahead = 0  # steps launched before the previous one was read
        self.discarded_rows = 0  # their rows whose sequence had stopped
        self._async = limits.async_steps
        # drafts may stay on the device: the speculator leaves them there, the executor reads them
        self._device_drafts = limits.device_drafts and proposes_on_device(self.speculator)
        self._on_device: DeviceDrafts | None = None  # this step's drafts, while they are on the device
        self._inflight: InFlight | None = None  # a launched step not committed yet
        self._last_result = 0.0  # when the last launched step's result arrived

    # -- thread-safe commands ---------------------------------------------------------
    def submit(self, request: PreparedRequest) -> None:
        self._inbox.put(commands.Submit(request))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(commands.Cancel(request_id))

    def stop(self) -> None:
        self._inbox.put(commands.Stop())

    def list_sessions(self, reply: Callable[[list], None]) -> None:
        """``reply(infos)`` on the engine thread: every named session (``GET /v1/sessions``)."""
        self._inbox.put(commands.ListSessions(reply))

    def close_session(self, name: str, reply: Callable[[ApiError | None], None]) -> None:
        """Close an idle named session; ``reply(None)`` or ``reply(error)`` (404, 409)."""
        self._inbox.put(commands.CloseSession(name, reply))

    def expire_idle_sessions(self) -> None:
        """Apply ``--session-idle-timeout`` now (the worker calls this every second)."""
        self._inbox.put(commands.ExpireIdle())

    def stats(self) -> dict:
        """Pool and session counters (read by the worker between steps)."""
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_used": self.pool.used_blocks,
            "kv_blocks_reserved": self.pool.reserved_blocks,
            "running": len(self.scheduler.by_id),
            "waiting": len(self.admission.queue),
            "queue_refused": self.admission.queue.refused,
            "steps": self.steps,
            "drafted_tokens": self.scheduler.drafted_tokens,
            "accepted_tokens": self.scheduler.accepted_tokens,
            "verify_blocks": self.scheduler.verify_blocks,
            "steps_ahead": self.steps_ahead,
            "discarded_rows": self.discarded_rows,
            "mask_seconds": self.scheduler.mask_clock.compute,
            "mask_blocked_seconds": self.scheduler.mask_clock.blocked,
            **self.step_book.stats(),
            **self.sessions.stats(),
        }

    # -- loop ------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to run and no launched step left to commit."""
        return self.scheduler.idle and self._inflight is None

    def run_forever(self) -> None:
        while not self._stopping:
            if self.idle:
                self.throughput.pause()
            self._drain(block=self.idle and not self._dispatch_due)
            if self._dispatch_due:
                self._dispatch()
            if not self.idle:
                self.step()
                self.throughput.tick(running=len(self.scheduler.by_id), queued=len(self.admission.queue),
                                     blocks_used=self.pool.used_blocks, blocks_total=self.pool.num_blocks)
        if self.scheduler.mask_workers is not None:
            self.scheduler.mask_workers.close()

    def run_until_idle(self) -> None:
        """Run until every submitted request has finished (tools and tests)."""
        while True:
            self._drain(block=False)
            if self._dispatch_due:
                self._dispatch()
            if self.idle:
                return
            self.step()

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            self._apply_command(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply_command(self, command: commands.Command) -> None:
        match command:
            case commands.Submit(request):
                self.admission.admit(request)
            case commands.Cancel(request_id):
                self._cancel(request_id)
            case commands.Call(function):
                function(self.stats())
            case commands.ListSessions(reply):
                self._dispatch_due |= bool(self.sessions.expire_idle())
                reply(self.sessions.describe())
            case commands.CloseSession(name, reply):
                self._close_session(name, reply)
            case commands.ExpireIdle():
                self._dispatch_due |= bool(self.sessions.expire_idle())
            case commands.Stop():
                self._stopping = True

    def plan_replay(self, request: PreparedRequest) -> PreparedRequest:
        """Generated-token replay computed ahead, on the caller's (control) thread.

        Reads the session's current (immutable) replay log and does the text
        comparison here, so the engine thread does not stall decoding on it;
        the engine uses the result only if the log is unchanged when the
        request starts, and computes it itself otherwise."""
        session = self.sessions.named.get(request.session_id) if request.session_id else None
        log = session.replay if session is not None else None
        if log is None or not log.turns:
            return request
        keys, kept = self.replayer.apply(log, prompt_keys(request.prompt_ids, request.images))
        return attrs.evolve(request, replay=ReplayPlan(log, tuple(keys), kept))

    def call(self, function: Callable[[dict], None]) -> None:
        """Run ``function(stats)`` on the engine thread between steps."""
        self._inbox.put(commands.Call(function))

    def _close_session(self, name: str, reply: Callable[[ApiError | None], None]) -> None:
        try:
            self.sessions.close(name)
        except KeyError:
            reply(errors.no_session(name))
        except SessionBusy:
            reply(errors.session_active(name))
        else:
            self._dispatch_due = True  # a slot is free
            reply(None)

    # -- admission -------------------------------------------------------------------
    def _fail(self, request_id: str, error: ApiError) -> None:
        self.emit(
            ev.Failed(request_id, error.status, error.message, error.type, error.code, error.param,
                      dict(error.metadata), error.retry_after)
        )

    @property
    def _dispatch_due(self) -> bool:
        """Something finished or freed a slot: the queue is to be looked at again."""
        return self.admission.due

    @_dispatch_due.setter
    def _dispatch_due(self, due: bool) -> None:
        self.admission.due = due

    def _dispatch(self) -> None:
        """Start the queued requests that may run now (:meth:`Admission.dispatch`)."""
        self.admission.dispatch()

    def _start(self, request: PreparedRequest, session: Session, waited: float) -> None:
        """Run ``request`` on ``session`` (it waited ``waited`` seconds in the queue)."""
        self._queue_seconds[request.id] = waited
        session.active = True
        session.last_used = time.monotonic()
        if request.sampling.seed is None:  # every draw is keyed by (seed, position)
            request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=random_seed()))
        keys = prompt_keys(request.prompt_ids, request.images)
        if session.name is not None and session.clean and session.replay.turns:
            plan = request.replay
            if plan is not None and plan.log is session.replay:
                replayed, kept = list(plan.keys), plan.kept  # prepared on the control thread
            else:
                replayed, kept = self.replayer.apply(session.replay, keys)
            if len(replayed) + request.completion_reservation <= self.config.max_context:
                keys = replayed
                session.replay = ReplayLog(session.replay.executed, kept)
        prompt, images = split_keys(keys, request)
        if images != request.images:
            request = attrs.evolve(request, images=images)
        reused = self.sessions.attach(session, keys)  # a dirty session reuses nothing
        session.clean = True  # its cache now holds exactly ``keys[:reused]``
        max_new = min(request.max_tokens or self.config.max_context, self.config.max_context - len(prompt))
        seq = SequenceState(
            request=request,
            handle=self._next_handle,
            max_new=max_new,
            tokens=prompt,
            keys=keys,
            prompt_len=len(prompt),
            session=session,
            computed=reused,
            cached=reused,
            detokenizer=IncrementalDetokenizer(self.tokenizer, hidden_ids(self.tokenizer, request.special_tokens)),
            stops=StopMatcher(request.stop, request.template_stops),
        )
        self._next_handle += 1
        self.scheduler.add(seq)
        self.emit(ev.Admitted(seq.id, seq.prompt_len, seq.cached))

    def _cancel(self, request_id: str) -> None:
        seq = self.scheduler.by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "cancelled", None)
            return
        self.admission.cancel(request_id)

    def _embedding(self, seq: SequenceState, index: int):
        """The embedding rows of the request's ``index``-th image, computed once per request."""
        rows = seq.embeddings.get(index)
        if rows is None:
            rows = seq.embeddings[index] = self.executor.embed_image(seq.request.images[index].image)
        return rows

    # -- one forward -----------------------------------------------------------------
    def _propose_drafts(self) -> None:
        """Ask the speculator for drafts for the sequences the next step decodes."""
        self._on_device = None  # drafts of a step that was never planned are not this step's
        if not self.speculator.max_draft:
            return
        requests = []
        for seq in self.scheduler.decoders():
            room = min(
                self.speculator.max_draft,
                seq.max_new - len(seq.generated) - 1,  # the block commits up to drafts + 1 tokens
                self.config.max_context - len(seq.tokens),  # the last draft sits at position len(tokens)
            )
            seq.drafts = []
            if room > 0:
                requests.append(DraftRequest(seq.handle, tuple(seq.tokens), tuple(seq.blocks), room))
        if not requests:
            return
        by_handle = {r.seq: r for r in requests}
        if self._device_drafts and all(self._host_free(seq) for seq in self.scheduler.decoders()
                                       if seq.handle in by_handle):
            found = self.speculator.propose_on_device(requests)  # type: ignore[attr-defined]
            self._on_device = found
            proposed = {seq: [0] * count for seq, count in found.counts.items()}  # placeholders
        else:
            proposed = self.speculator.propose(requests)
        for seq in self.scheduler.decoders():
            request = by_handle.get(seq.handle)
            if request is not None:
                seq.drafts = list(proposed.get(seq.handle, ()))[: request.max_draft]

    @staticmethod
    def _host_free(seq: SequenceState) -> bool:
        """Nothing the host computes for the verify rows depends on the drafts' values
        (grammar masks and penalties do), so they can stay on the device."""
        request = seq.request
        generated = len(seq.generated)
        masked = any(not (hasattr(p, "idle") and p.idle(generated)) for p in request.processors)
        return not masked and not request.sampling.penalized

    def _place_device_drafts(self, step: Step) -> None:
        """Point every verify chunk of ``step`` at its row of the drafts on the device."""
        found, self._on_device = self._on_device, None
        if found is None:
            return
        step.drafts = found.ids
        for chunk in step.chunks:
            if chunk.seq in found.rows and len(chunk.tokens) > 1:
                chunk.draft_row = found.rows[chunk.seq]

    def _encode_images(self) -> None:
        """Encode the images of prompts still prefilling, before the step is planned:
        an image the executor cannot encode fails its own request (500) and nothing
        else, and planning never stops halfway through (block copies promised)."""
        for seq in list(self.scheduler.running):
            if seq.phase is not Phase.PREFILL or not seq.request.images:
                continue
            try:
                for index, placed in enumerate(seq.request.images):
                    if placed.start + placed.image.rows > seq.computed:  # rows a cached prefix does not cover
                        self._embedding(seq, index)
            except Exception as exc:
                log.exception("image encoding failed")
                self._finish(seq, None, None)
                self._fail(seq.id, errors.image_encoding_failed(exc))

    def step(self) -> None:
        if self._inflight is not None:  # a launched step: launch the next one, then commit it
            self._step_ahead()
            return
        self._propose_drafts()
        self._encode_images()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            return
        step, plan, copies = scheduled
        self._place_device_drafts(step)
        started = self.clock()
        if self._pipelined(plan):
            try:
                self._copy_blocks(copies)
                pending = self.executor.launch(step)  # type: ignore[attr-defined]
            except Exception as exc:
                self._failed(plan, exc)
                return
            self._inflight = InFlight(scheduled, pending, started)
            return
        try:
            self._copy_blocks(copies)
            try:
                output = self.executor.step(step)
            finally:  # no mask computation of this step outlives it
                for chunk in step.chunks:
                    if isinstance(chunk.masks, PendingMasks):
                        chunk.masks.wait()
            self._check_output(step, output)
        except Exception as exc:  # an executor failure fails this batch, not the worker
            self._failed(plan, exc)
            return
        self._record(plan, self.clock() - started)
        self._update(scheduled, output)

    # -- asynchronous steps ------------------------------------------------------------
    def _followable(self, seq: SequenceState) -> bool:
        """A decoding sequence whose next row needs nothing the host computes from its
        previous token (grammar masks, penalty history, drafts)."""
        request = seq.request
        generated = len(seq.generated)
        masked = any(not (hasattr(p, "idle") and p.idle(generated)) for p in request.processors)
        return seq.phase is Phase.DECODE and not seq.drafts and not masked and not request.sampling.penalized

    def _pipelined(self, plan: list[tuple[SequenceState, int]]) -> bool:
        """Launch this step without waiting for it: an asynchronous executor, no
        speculator, and every row a one-row decode of a followable sequence."""
        return (self._async and not self.speculator.max_draft
                and all(rows == 1 and self._followable(seq) for seq, rows in plan))

    def _step_ahead(self) -> None:
        """Step N is in flight: launch step N+1 (its rows following N's ids) when
        every running sequence decodes in N and needs another token, then wait
        for N and commit it. N+1 stays in flight."""
        current, self._inflight = self._inflight, None
        ahead = self._launch_ahead(current)
        try:
            output = current.pending.result()
            self._check_output(current.scheduled.step, output)
        except Exception as exc:
            if ahead is not None:  # it followed the failed step's ids: discard it too
                try:
                    ahead.pending.result()
                except Exception:
                    pass
            self._failed(current.scheduled.plan, exc)
            return
        now = self.clock()
        self._record(current.scheduled.plan, now - max(current.started, self._last_result))
        self._last_result = now
        self._update(current.scheduled, output)
        if ahead is None:
            return
        self.steps_ahead += 1
        self.discarded_rows += sum(seq.phase is Phase.FINISHED for seq, _ in ahead.scheduled.plan)
        if any(seq.phase is not Phase.FINISHED for seq, _ in ahead.scheduled.plan):
            self._inflight = ahead
            return
        try:  # every sequence of the launched step stopped at N: nothing of it is needed
            ahead.pending.result()
        except Exception:
            log.exception("a discarded step failed")

    def _launch_ahead(self, current: "InFlight") -> "InFlight | None":
        running = self.scheduler.running
        handles = {seq.handle for seq, _ in current.scheduled.plan}
        if not running or not self._pipelined(current.scheduled.plan):
            return None
        for seq in running:
            if (seq.handle not in handles or not self._followable(seq)
                    or len(seq.generated) + 1 >= seq.max_new):  # new, or it will stop at N
                return None
        scheduled = self.scheduler.schedule_ahead()
        if scheduled is None:
            return None
        started = self.clock()
        try:
            self._copy_blocks(scheduled.copies)
            pending = self.executor.launch(scheduled.step)  # type: ignore[attr-defined]
        except Exception:  # the step is planned again, synchronously, after N
            log.exception("launching a step ahead failed")
            return None
        return InFlight(scheduled, pending, started)

    # -- committing a step -------------------------------------------------------------
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.executor.copy_blocks(copies)
            self.speculator.copy_blocks(copies)

    @staticmethod
    def _check_output(step, output) -> None:
        for chunk in step.chunks:
            got = len(output.tokens.get(chunk.seq, ()))
            if got != chunk.sample:
                raise RuntimeError(f"the executor returned {got} sampled ids for sequence {chunk.seq}, "
                                   f"expected {chunk.sample}")
            if chunk.draft_row >= 0 and not 0 <= output.accepted.get(chunk.seq, -1) < len(chunk.tokens):
                raise RuntimeError(f"the executor returned no accepted count for the device drafts of sequence "
                                   f"{chunk.seq}")

    def _failed(self, plan: list[tuple[SequenceState, int]], exc: Exception) -> None:
        """An executor failure fails this batch, not the worker."""
        log.error("executor step failed", exc_info=exc)
        for seq, _ in plan:
            if seq.phase is Phase.FINISHED:
                continue
            self._finish(seq, None, None)
            self._fail(seq.id, errors.execution_failed(exc))

    def _record(self, plan: list[tuple[SequenceState, int]], seconds: float) -> None:
        self.steps += 1
        kind = StepBook.kind(plan)
        self.step_book.record(kind, seconds)
        self.prefill_budget.observe(kind[1], kind[2], seconds)

    def _update(self, scheduled: ScheduledStep, output) -> None:
        """The scheduler commits the step (:meth:`Scheduler.update`); the speculator sees what was kept."""
        update = self.scheduler.update(scheduled, output, self._prefilled, self._on_token)
        self.throughput.prompt += update.prompt_rows
        self.speculator.observe(scheduled.step, output, update.committed_rows)

    def _prefilled(self, seq: SequenceState) -> None:
        session = seq.session
        session.tokens = seq.keys[: seq.computed]
        self.sessions.publish(session)
        self.sessions.snapshot(session)
        self.emit(ev.Started(seq.id, seq.prompt_len, seq.cached, self._queue_seconds.pop(seq.id, 0.0)))

    def _on_token(self, seq: SequenceState, token: int, logprobs: TokenLogprobs | None = None) -> None:
        request = seq.request
        failure = errors.constraint_failure(request.processors)
        if failure is not None:  # the token was drawn without the constraint: never emitted
            self._finish(seq, None, None)
            self._fail(seq.id, failure)
            return
        if request.stream:
            seq.session.confirmed = True  # first raw output confirms a streamed session
        self.throughput.generated += 1
        output = push_token(seq, token, logprobs, self.end_ids, self.tokenizer)
        if output.event is not None:
            self.emit(output.event)
        if output.finish is not None:
            self._finish(seq, output.finish, output.matched_stop)

    def _finish(self, seq: SequenceState, reason: str | None, matched_stop: str | None) -> None:
        """End ``seq``: ``reason`` None means it failed (the caller reports why)."""
        if seq.phase is Phase.FINISHED:
            return
        seq.phase = Phase.FINISHED
        self._queue_seconds.pop(seq.id, None)
        self.scheduler.remove(seq)
        self.executor.release_sequence(seq.handle)
        self.speculator.release_sequence(seq.handle)
        session = seq.session
        # Positions with K/V in the cache: the prompt and every generated token but the last.
        session.tokens = seq.keys[: seq.computed]
        if len(session.slot.blocks) > self.pool.blocks_for(seq.computed):
            session.slot.truncate(self.pool.blocks_for(seq.computed))
        if reason is not None:  # not after an executor failure
            self.sessions.publish(session)
        success = reason in ("stop", "length")
        if success:
            session.confirmed = True
            if matched_stop is None:  # a stop-trimmed answer cannot be matched to its ids
                executed = tuple(seq.keys[: seq.prompt_len])
                turns = [t for t in session.replay.turns if t[0] < seq.prompt_len]
                turns.append((seq.prompt_len, self.replayer.turn_ids(seq.generated)))
                session.replay = ReplayLog(executed, tuple(turns))
            else:
                session.replay = ReplayLog()
        else:
            session.clean = False  # an interrupted turn replays from scratch
            session.replay = ReplayLog()
        session.active = False
        session.last_used = time.monotonic()
        if session.name is None or not session.confirmed:
            self._drop_session(session)
        self._dispatch_due = True  # a running place is free (and maybe a slot, or this session)
        if reason is not None:
            self.emit(
                ev.Done(
                    seq.id,
                    reason,
                    matched_stop,
                    seq.prompt_len,
                    len(seq.generated),
                    seq.cached,
                    None if matched_stop is not None else tuple(seq.generated),
                    None if matched_stop is not None else tuple(seq.chars),
                    seq.drafted,
                    seq.accepted,
                )
            )

    def _drop_session(self, session: Session) -> None:
        """Close a temporary or unconfirmed session; requests queued for it stay in the
        queue and get a fresh one when they start."""
        session.waiting.clear()
        self.sessions.drop(session)

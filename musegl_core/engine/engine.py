"""The engine: admits prepared requests, runs their steps, emits events.

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

Steps run in :class:`~musegl_core.engine.loop.StepLoop`: the scheduler plans
one, the executor runs it, and :meth:`Scheduler.update
<musegl_core.engine.scheduler.Scheduler.update>` commits it. A step commits
0..k+1 tokens per sequence: a decoding sequence may carry draft tokens from a
speculator (:mod:`musegl_core.engine.speculator`); the scheduler keeps the
sampled tokens the drafts agree with, rolls the length back past the rest,
and hands the committed tokens one by one to this engine (``_on_token``:
stops, ``max_tokens``, detokenization; ``_finish``: session bookkeeping),
exactly as if they had been decoded one per step.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

import attrs

from musegl_core.engine import commands
from musegl_core.engine import events as ev
from musegl_core.engine.admission import Admission
from musegl_core.engine.detokenize import IncrementalDetokenizer, hidden_ids
from musegl_core.engine.executor import DEFAULT_PREFILL_CHUNK, Executor, ExecutorLimits, TokenLogprobs
from musegl_core.engine.identity import prompt_keys, split_keys
from musegl_core.engine.kv_disk import DiskTier, DiskTierError, block_format, open_disk_tier
from musegl_core.engine.kv_host import HostTier, default_host_bytes, host_kv
from musegl_core.engine.kv_memory import room_line
from musegl_core.engine.kv_suspend import OnDemand
from musegl_core.engine.memory import available_ram
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.launch_gate import LaunchGate
from musegl_core.engine.kv_sizing import plan_pool
from musegl_core.engine.prefill_budget import PrefillBudget
from musegl_core.engine.prefill_sharing import PrefillSharing
from musegl_core.engine.randomness import random_seed
from musegl_core.engine.replay import ReplayLog, ReplayPlan, Replayer
from musegl_core.engine.retention import residency
from musegl_core.engine.loop import StepLoop
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.output import push_token
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.errors import EngineError, NoSession, SessionActive, constraint_failure
from musegl_core.engine.prefix_miss import PrefixHistory
from musegl_core.engine.sessions import Session, SessionBusy, SessionTable
from musegl_core.engine.speculator import NoSpeculator, Speculator
from musegl_core.engine.step_book import StepBook
from musegl_core.engine.stops import StopMatcher
from musegl_core.engine.throughput import ThroughputLog
from musegl_core.engine.trace import Trace
from musegl_core.errors import ConfigError

log = logging.getLogger("musegl.engine")


@attrs.frozen
class EngineConfig:
    max_context: int = 8192
    max_sessions: int = 4
    max_inflight_requests: int = 4
    max_queued_requests: int = 1024
    max_decode_sequences: int = 4
    max_prefill_chunk: int | None = None  # None: the executor's (ExecutorLimits.prefill_chunk)
    solo_prefill_chunk: int | None = None  # None: the executor's (ExecutorLimits.solo_prefill_chunk)
    prefix_cache_entries: int = 0
    evict_idle_sessions: bool = False
    kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    kv_cache_fraction: float = 0.9
    #: the host tier's bytes (``--kv-offload-memory``; None: the default, engine/kv_host.py; 0: off)
    kv_offload_memory: int | None = None
    prefix_caching: bool = True
    session_idle_timeout: float | None = None
    soft_session_idle_timeout: float = 600.0
    grammar_threads: int | None = None  # None: 0 for an executor on the host CPU, else 2
    prefill_stall_factor: float = 6.0
    throughput_log_interval: float = 10.0  # seconds between throughput lines while busy (0: none)
    spec_verify_rows: int | None = None  # the verify-rows budget (None: the executor's; 0: none)
    trace_steps: str | None = None  # a file for the step and request timeline (engine/trace.py)
    #: sliding layers keep only their window on the device, where the executor offers it
    #: (``--sliding-window-kv``, ``use_sliding_pages``; docs/engine.md "Sliding layers keep their window")
    sliding_window_kv: bool = False
    #: the disk tier (``--kv-offload-dir``, ``--kv-offload-disk``; engine/kv_disk.py): None, None for none
    kv_offload_dir: str | None = None
    kv_offload_disk: int | None = None

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


def grammar_threads(configured: int | None, limits: ExecutorLimits) -> int:
    """Mask threads: as configured, else none when the forward runs on the host CPU (measured on
    2 cores: overlapping threads cost constrained decoding 5-9 %, masks between steps under 1 %)
    and 2 otherwise (a GPU forward leaves the cores idle)."""
    if configured is not None:
        return configured
    return 0 if limits.host_compute else 2


def prefill_chunk(configured: int | None, limits: ExecutorLimits) -> int:
    """Most prompt rows a step computes: as configured (``--max-prefill-chunk``), else the
    executor's ``limits.prefill_chunk``, else :data:`DEFAULT_PREFILL_CHUNK`."""
    if configured is not None:
        return configured
    return limits.prefill_chunk or DEFAULT_PREFILL_CHUNK


def solo_prefill_chunk(configured: int | None, limits: ExecutorLimits, chunk: int) -> int:
    """Most prompt rows a step computes when one sequence prefills alone: as configured
    (``--solo-prefill-chunk``), else the executor's ``limits.solo_prefill_chunk``, never fewer
    than ``chunk`` (the prefill chunk). A configured value wider than the executor's widest
    step (``max_step_tokens``) is refused (:class:`~musegl_core.errors.ConfigError`)."""
    if configured is not None and configured > max(chunk, limits.max_step_tokens):
        raise ConfigError(f"--solo-prefill-chunk {configured} is wider than the {limits.max_step_tokens} rows "
                          "the executor takes in one step (on CUDA: what the memory beside the KV pool holds)")
    solo = configured if configured is not None else limits.solo_prefill_chunk
    return min(max(chunk, solo or chunk), max(chunk, limits.max_step_tokens))


def verify_rows(configured: int | None, limits: ExecutorLimits) -> int | None:
    """The verify-rows budget of a step (``StepLoop.draft_cap``): as configured
    (``--spec-verify-rows``; 0: no budget), else the executor's
    ``limits.verify_rows`` (None: no budget)."""
    if configured is not None:
        return configured or None
    return limits.verify_rows


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
        companions, window, reach = self._sliding_pages(config, executor)
        blocks = plan_pool(config, executor, self.speculator, pages_per_block=1 + companions)
        self.pool = KVPool(blocks * (1 + companions), block_size, companions)
        expect_taps = getattr(executor, "expect_taps", None)  # optional (docs/executor.md section 8)
        if self.speculator.taps and callable(expect_taps):
            expect_taps(tuple(self.speculator.taps))
        executor.allocate_kv(self.pool.num_blocks)
        self.host = self._host_tier(config, executor, companions)
        self.disk = self._disk_tier(config, executor, companions)
        log.info("%s", room_line(device_blocks=blocks, block_size=block_size,
                                 block_bytes=executor.kv_bytes_per_block() + self.speculator.kv_bytes_per_block(),
                                 max_context=config.max_context, companions=companions, window=window,
                                 host_bytes=self.host.num_pages * self.host.page_bytes if self.host else None,
                                 disk_bytes=self.disk.capacity if self.disk is not None else None))
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
            window=window,
            reach=reach,
        )
        if self.host is not None:
            self.sessions.host = self.host
            self.pool.on_evict = self.sessions.evicted_to_host
        #: blocks on demand for running requests, suspended to the host tier (engine/kv_suspend.py);
        #: None without a host tier: a running request reserves its blocks to its end at admission
        self.on_demand = OnDemand(self.sessions) if self.host is not None else None
        self.sessions.on_demand = self.on_demand
        self.prefix_history = PrefixHistory(tokenizer)  # why a prefix missed (engine/prefix_miss.py)
        self.sessions.history = self.prefix_history
        limits = executor.limits
        drafts = config.max_decode_sequences * self.speculator.max_draft
        chunk = prefill_chunk(config.max_prefill_chunk, limits)
        solo = solo_prefill_chunk(config.solo_prefill_chunk, limits, chunk)
        max_step = min(limits.max_step_tokens, max(config.max_decode_sequences + drafts + chunk, solo))
        self.prefill_budget = PrefillBudget(config.prefill_stall_factor, chunk)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerLimits(config.max_decode_sequences, chunk, max_step, tuple(limits.step_sizes), solo),
            embed=self._embedding,
            taps=tuple(self.speculator.taps),
            mask_threads=grammar_threads(config.grammar_threads, limits),
            budget=self.prefill_budget,
            sharing=(PrefillSharing(self.pool, self.sessions.cache)
                     if self.sessions.cache is not None and not companions else None),
            window=window,
        )
        if self.host is not None and companions:  # sliding pages leaving the window go down, for rewinds
            self.scheduler.window_down = self.sessions.window_down
        self.scheduler.on_demand = self.on_demand
        self.end_ids = frozenset(tokenizer.end_of_generation_ids)
        self.replayer = Replayer(tokenizer, self.end_ids)
        self._inbox: queue.Queue = queue.Queue()
        self.admission = Admission(config, self.sessions, self.replayer, self.scheduler.by_id, self._start,
                                   self._fail)
        self._queue_seconds: dict[str, float] = {}  # how long each running request waited, until Started
        self.throughput = ThroughputLog(config.throughput_log_interval)
        self._next_handle = 0
        self._stopping = False
        self.step_book = StepBook()
        self.trace = Trace.open(config.trace_steps) if config.trace_steps else None
        #: closed while a step is launched (asynchronous executors): the worker's other threads wait at it
        self.launch_gate = LaunchGate()
        self.loop = StepLoop(executor, self.speculator, self.scheduler, config.max_context, clock, self.step_book,
                             self.prefill_budget, self.throughput, embed=self._embedding,
                             on_prefilled=self._prefilled, on_token=self._on_token, fail=self._end_failed,
                             verify_rows=verify_rows(config.spec_verify_rows, limits), trace=self.trace,
                             gate=self.launch_gate)
        if self.speculator.max_draft:
            budget = self.loop.verify_rows
            log.info("speculation: up to %d drafts a sequence; %s", self.speculator.max_draft,
                     "no verify-rows budget" if budget is None else
                     f"at most {budget} verify rows a step (more than {budget // 2} decoding sequences: no drafts)")

    def _write_through(self, session: Session) -> None:
        """With a disk tier, a request whose residency asks for it (``1h``, ``24h``;
        engine/retention.py) leaves its blocks on disk too, retained for the residency's time."""
        kept = residency(session.retention)
        if self.disk is not None and kept is not None and kept.write_through:
            self.sessions.write_through(session, until=time.time() + kept.seconds)

    def _disk_tier(self, config: EngineConfig, executor: Executor, companions: int) -> DiskTier | None:
        """The disk tier below the host tier (``--kv-offload-dir``, ``--kv-offload-disk``;
        engine/kv_disk.py), or None. Refused in one line (:class:`ConfigError`) where it cannot
        work: no host tier above it, an executor that does not state its KV identity, a
        directory it cannot use."""
        if config.kv_offload_dir is None:
            return None
        if not config.kv_offload_disk:
            raise ConfigError("--kv-offload-dir needs --kv-offload-disk SIZE (how much of the disk the tier may fill)")
        host = getattr(self, "host", None)
        if host is None:
            raise ConfigError("--kv-offload-dir: the disk tier sits below the host tier (--kv-offload-memory), "
                              "which is off here; leave --kv-offload-dir out")
        try:
            disk = open_disk_tier(config.kv_offload_dir, config.kv_offload_disk, block_format(executor, companions))
        except DiskTierError as exc:
            raise ConfigError(f"--kv-offload-dir: {exc}") from None
        host.lower = disk
        return disk

    def _host_tier(self, config: EngineConfig, executor: Executor, companions: int) -> HostTier | None:
        """The host tier below the device pool (``--kv-offload-memory``, engine/kv_host.py), allocated
        by the executor; None, with one start-up line saying why, where it is off. A size asked for
        where the executor cannot copy KV pages to host memory is refused."""
        asked = config.kv_offload_memory
        if asked == 0:
            log.info("KV host tier: off (--kv-offload-memory 0)")
            return None
        capable = host_kv(executor)
        why = None
        if capable is None:
            why = (f"the {executor.info.backend!r} executor cannot copy KV pages to host memory (the optional "
                   "HostKV capability, docs/executor.md)")
        elif self.speculator.kv_bytes_per_block():
            why = "the speculator keeps KV of its own, which the host tier would not move with the target's"
        if why is not None:
            if asked is not None:
                raise ConfigError(f"--kv-offload-memory: {why}; leave the flag out or pass 0")
            log.info("KV host tier: off: %s", why)
            return None
        page_bytes = executor.kv_bytes_per_block() // (1 + companions)
        if asked is None:
            slot_bytes = config.needed_blocks(executor.block_size) * executor.kv_bytes_per_block()
            asked = default_host_bytes(slot_bytes=slot_bytes, available_ram=available_ram())
        pages = asked // page_bytes
        if pages < 1 + companions:
            log.info("KV host tier: off (%d bytes hold no block of %d)", asked, page_bytes * (1 + companions))
            return None
        capable.allocate_host_kv(pages)
        return HostTier(pages, page_bytes, capable)

    def _sliding_pages(self, config: EngineConfig, executor: Executor) -> tuple[int, int | None, int | None]:
        """With ``--sliding-window-kv``, sliding layers keep their window: the executor must offer it
        (optional ``use_sliding_pages()``: it switches to the paged layout of layer groups and returns
        (sliding pages per block, window[, sliding layers]), or None) and a speculator must follow
        the pages (``follows_sliding_pages``: its K/V indexed by the full layers' block ids, which
        keep every position, as DFlash's context store); else the flag is refused in one line
        (:class:`~musegl_core.errors.ConfigError`). Returns (sliding pages per block, window, the
        positions a rewind past the window recomputes: sliding layers x window, None when the executor
        did not say), or (0, None, None) without the flag."""
        if not config.sliding_window_kv:
            return 0, None, None
        use = getattr(executor, "use_sliding_pages", None)
        drafting = self.speculator.max_draft or self.speculator.taps
        if drafting and not getattr(self.speculator, "follows_sliding_pages", False):
            raise ConfigError(f"--sliding-window-kv: the {type(self.speculator).__name__} speculator keeps K/V "
                              "that does not follow sliding pages: drop one of them")
        found = use() if callable(use) else None
        if found is None:
            raise ConfigError(f"--sliding-window-kv: the {type(executor).__name__} executor does not keep sliding "
                              "layers' windows for this model and device (docs/engine.md \"Sliding layers keep "
                              "their window\" lists where it does); serve without it")
        companions, window, *layers = found
        return companions, window, (layers[0] * window if layers else None)

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

    def close_session(self, name: str, reply: Callable[[EngineError | None], None]) -> None:
        """Close an idle named session; ``reply(None)`` or ``reply(error)`` (:class:`NoSession`,
        :class:`SessionActive`)."""
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
            "steps": self.loop.steps,
            "drafted_tokens": self.scheduler.drafted_tokens,
            "accepted_tokens": self.scheduler.accepted_tokens,
            "verify_blocks": self.scheduler.verify_blocks,
            "budget_cut_steps": self.loop.budget_cut_steps,
            "budget_skipped_steps": self.loop.budget_skipped_steps,
            "steps_ahead": self.loop.steps_ahead,
            "discarded_rows": self.loop.discarded_rows,
            "mask_seconds": self.scheduler.mask_clock.compute,
            "mask_blocked_seconds": self.scheduler.mask_clock.blocked,
            **self.step_book.stats(),
            **self.sessions.stats(),
            **self._tier_stats(),
            **(self.scheduler.sharing.stats() if self.scheduler.sharing is not None else {}),
        }

    def _tier_stats(self) -> dict:
        """Per-tier bytes and hits (``cache_source``: device, host) and the host tier's counters."""
        sessions = self.sessions
        block_bytes = self.executor.kv_bytes_per_block() // self.pool.pages_per_block
        stats = {"kv_tier_bytes_device": self.pool.used_blocks * block_bytes,
                 "kv_tier_capacity_bytes_device": self.pool.num_blocks * block_bytes}
        for tier in ("device", "host", "disk"):
            stats[f"kv_tier_hits_{tier}"] = sessions.tier_hits[tier]
            stats[f"kv_tier_hit_tokens_{tier}"] = sessions.tier_hit_tokens[tier]
        if self.disk is not None:
            disk = self.disk.stats()
            stats["kv_tier_bytes_disk"] = disk["kv_disk_bytes"]
            stats["kv_tier_capacity_bytes_disk"] = disk["kv_disk_capacity_bytes"]
            stats.update(disk)
        stats["sessions_moved_down"] = sessions.moved_down
        if self.pool.companions:
            stats["kv_window_recomputed_rows"] = self.scheduler.window_rows
        if self.host is not None:
            stats["kv_tier_bytes_host"] = self.host.used_bytes
            stats["kv_tier_capacity_bytes_host"] = self.host.num_pages * self.host.page_bytes
            stats["kv_host_offloads"] = sessions.offloads
            stats["kv_host_cached_blocks"] = len(sessions.host_cached)
            stats["kv_host_window_blocks"] = len(sessions.window_lru)
            stats["kv_window_offloaded_blocks"] = sessions.window_offloaded_blocks
            stats["kv_window_restores"] = sessions.window_restores
            stats["kv_window_restored_blocks"] = sessions.window_restored_blocks
            stats.update(self.host.stats())
        if self.on_demand is not None:
            stats.update(self.on_demand.stats())
        return stats

    # -- loop ------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nothing to run and no launched step left to commit."""
        return self.scheduler.idle and self.loop.inflight is None

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

    def run_until_idle(self, after_step: Callable[[], None] | None = None, max_steps: int | None = None) -> None:
        """Run until every submitted request has finished (tools and tests). ``after_step`` runs
        after each step (a test's checks); more than ``max_steps`` steps raise RuntimeError (a
        test's guard against a deadlock)."""
        steps = 0
        while True:
            self._drain(block=False)
            if self._dispatch_due:
                self._dispatch()
            if self.idle:
                return
            if max_steps is not None and steps >= max_steps:
                raise RuntimeError(f"not idle after {max_steps} steps: {self.stats()}")
            self.step()
            steps += 1
            if after_step is not None:
                after_step()

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

    def _close_session(self, name: str, reply: Callable[[EngineError | None], None]) -> None:
        try:
            self.sessions.close(name)
        except KeyError:
            reply(NoSession(name))
        except SessionBusy:
            reply(SessionActive(name))
        else:
            self._dispatch_due = True  # a slot is free
            reply(None)

    # -- admission -------------------------------------------------------------------
    def _fail(self, request_id: str, error: EngineError) -> None:
        self.emit(ev.Failed(request_id, error))

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

    def _start(self, request: PreparedRequest, session: Session, waited: float) -> int | None:
        """Run ``request`` on ``session`` (it waited ``waited`` seconds in the queue). Blocks on
        demand: the request reserves the KV blocks it may still take to its end; when the pool
        has not them even after idle sessions made room, nothing starts and the blocks it
        lacked are returned (the session keeps the prefix it shares with the prompt)."""
        keys = prompt_keys(request.prompt_ids, request.images)
        replay = None
        if session.name is not None and session.clean and session.replay.turns:
            plan = request.replay
            if plan is not None and plan.log is session.replay:
                replayed, kept = list(plan.keys), plan.kept  # prepared on the control thread
            else:
                replayed, kept = self.replayer.apply(session.replay, keys)
            if len(replayed) + request.completion_reservation <= self.config.max_context:
                keys = replayed
                replay = ReplayLog(session.replay.executed, kept)
        prompt, images = split_keys(keys, request)
        if self.on_demand is not None:
            self.on_demand.refused_pages, self.on_demand.never = 0, False
        lacking = self.sessions.restore_room(session, keys)
        if lacking:  # its blocks in the host tier cannot come back yet: they stay there, the request waits
            return -(-lacking // self.pool.pages_per_block)
        held = list(session.tokens) if session.clean else []  # what the session held before this prompt
        reused = self.sessions.attach(session, keys)  # a dirty session reuses nothing
        miss = self.prefix_history.diagnose(name=session.name, new=not held, held=held, salt=session.salt,
                                            prompt=keys, reused=reused, block_size=self.sessions.pool.block_size)
        session.clean = True  # its cache now holds exactly ``keys[:reused]``
        max_new = min(request.max_tokens or self.config.max_context, self.config.max_context - len(prompt))
        need = self.sessions.run_blocks(session, reused, len(prompt) + max_new)
        # a rewind past the sliding layers' window recomputes their K/V from ``start`` (sliding pages)
        start = self.sessions.window_start(session.slot.blocks, reused) if self.pool.companions else reused
        pages = self.sessions.window_pages(reused, start, self.scheduler.limits.max_step_tokens)
        ceiling = None
        if self.on_demand is not None:  # blocks on demand: the guarantee over device plus host, nothing reserved
            ceiling = self.on_demand.ceiling(session, need, pages)
            short = self.on_demand.lacking(session, ceiling)
            if short:
                return -(-short // self.pool.pages_per_block)
            if not self.sessions.reserve_run(session, 0, pages):  # a window recomputation's own pages
                return -(-pages // self.pool.pages_per_block)
        elif not self.sessions.reserve_run(session, need, pages):
            return need
        self.prefix_history.ran(keys, session.salt)
        if replay is not None:
            session.replay = replay
        if images != request.images:
            request = attrs.evolve(request, images=images)
        self._queue_seconds[request.id] = waited
        session.active = True
        session.last_used = time.monotonic()
        if request.retention is not None:  # the latest ask sets how long the idle session is kept
            session.retention = request.retention
        if request.sampling.seed is None:  # every draw is keyed by (seed, position)
            request = attrs.evolve(request, sampling=attrs.evolve(request.sampling, seed=random_seed()))
        seq = SequenceState(
            request=request,
            handle=self._next_handle,
            max_new=max_new,
            tokens=prompt,
            keys=keys,
            prompt_len=len(prompt),
            session=session,
            computed=start,
            cached=start,
            rewound=reused,
            detokenizer=IncrementalDetokenizer(self.tokenizer, hidden_ids(self.tokenizer, request.special_tokens)),
            stops=StopMatcher(request.stop, request.template_stops),
        )
        self._next_handle += 1
        if ceiling is not None:
            self.on_demand.started(seq, ceiling)
        self.scheduler.add(seq)
        if self.trace is not None:
            self.trace.request("admitted", seq.id, prompt=seq.prompt_len, cached=seq.cached, waited=round(waited, 6))
        if miss is not None:
            log.info("request %s: prefix miss (%s) at position %d: reused %d of %d held; before %r, held %r, "
                     "prompt %r", seq.id, miss.cause, miss.position, miss.reused, miss.held, miss.before,
                     miss.held_text, miss.prompt_text)
        self.emit(ev.Admitted(seq.id, seq.prompt_len, seq.cached, miss))
        return None

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

    # -- one forward (engine/loop.py): schedule, run, update -----------------------------
    def step(self) -> None:
        self.loop.step()

    @property
    def steps(self) -> int:
        """Steps committed so far."""
        return self.loop.steps

    # -- what a step committed (Scheduler.update calls these) --------------------------
    def _prefilled(self, seq: SequenceState) -> None:
        session = seq.session
        session.tokens = seq.keys[: seq.computed]
        self.sessions.publish(session)
        self.sessions.snapshot(session)
        if self.trace is not None:
            self.trace.request("first_token", seq.id)
        self.emit(ev.Started(seq.id, seq.prompt_len, seq.cached, self._queue_seconds.pop(seq.id, 0.0)))

    def _on_token(self, seq: SequenceState, token: int, logprobs: TokenLogprobs | None = None) -> None:
        request = seq.request
        failure = constraint_failure(request.processors)
        if failure is not None:  # the token was drawn without the constraint: never emitted
            self._end_failed(seq, failure)
            return
        if request.stream:
            seq.session.confirmed = True  # first raw output confirms a streamed session
        self.throughput.generated += 1
        output = push_token(seq, token, logprobs, self.end_ids, self.tokenizer)
        if output.event is not None:
            self.emit(output.event)
        if output.finish is not None:
            self._finish(seq, output.finish, output.matched_stop)

    def _end_failed(self, seq: SequenceState, error: EngineError) -> None:
        """End ``seq`` because it cannot go on, and report why."""
        self._finish(seq, None, None)
        self._fail(seq.id, error)

    def _finish(self, seq: SequenceState, reason: str | None, matched_stop: str | None) -> None:
        """End ``seq``: ``reason`` None means it failed (the caller reports why)."""
        if seq.phase is Phase.FINISHED:
            return
        seq.phase = Phase.FINISHED
        self._queue_seconds.pop(seq.id, None)
        if self.trace is not None:
            self.trace.request("finished", seq.id, reason=reason or "failed", generated=len(seq.generated))
        self.scheduler.remove(seq)
        self.executor.release_sequence(seq.handle)
        self.speculator.release_sequence(seq.handle)
        session = seq.session
        # Positions with K/V in the cache: the prompt and every generated token but the last (those
        # still on the device, for a request cancelled while suspended to the host tier).
        computed = seq.computed if self.on_demand is None else self.on_demand.finish(seq)
        session.tokens = seq.keys[: computed]
        self.sessions.end_run(session, computed)  # blocks on demand: it keeps what it filled
        if reason is not None:  # not after an executor failure
            self.sessions.publish(session)
            self._write_through(session)
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

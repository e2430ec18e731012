"""One forward at a time: schedule, run, update.

:class:`StepLoop` is what :meth:`Engine.step <musegl_core.engine.engine.Engine.step>`
does, in the order nano-vllm's step reads::

    drafts = speculator.propose(...)           # drafts for the next decoders
    scheduled = scheduler.schedule()           # the step, its (sequence, rows), block copies
    output = executor.step(scheduled.step)     # the forward and the sampler
    scheduler.update(scheduled, output, ...)   # commit; each committed id to the engine's output
    speculator.observe(...)                    # what was kept

On an asynchronous executor (``ExecutorLimits.async_steps``) a step whose rows
all decode without anything the host computes from the previous id is
launched and left in flight; the next call launches step N+1 (its rows
following N's ids on the device) before it waits for N and commits it.
Drafts may stay on the device (``ExecutorLimits.device_drafts`` and a
speculator that proposes there): the executor then compares them and reports
``StepOutput.accepted``.

Drafts are bounded by a verify-rows budget ``B`` (``--spec-verify-rows``, by
default ``ExecutorLimits.verify_rows``): a step that decodes ``b`` sequences
gives each at most ``B // b - 1`` drafts, and none when that is below 1
(:meth:`StepLoop.draft_cap`), so speculation never turns a decode step into a
prefill-sized one as the batch grows.

An executor failure fails the requests of that step (``ExecutionFailed``), not the engine.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import attrs

from musegl_core.engine import errors
from musegl_core.engine.executor import Executor, PendingStep, StepOutput
from musegl_core.engine.launch_gate import LaunchGate
from musegl_core.engine.masks import PendingMasks
from musegl_core.engine.prefill_budget import PrefillBudget
from musegl_core.engine.request import Phase, SequenceState
from musegl_core.engine.scheduler import ScheduledStep, Scheduler, TokenFn
from musegl_core.engine.speculator import DeviceDrafts, DraftRequest, Speculator, proposes_on_device
from musegl_core.engine.step_book import StepBook
from musegl_core.engine.throughput import ThroughputLog
from musegl_core.engine.trace import Trace

log = logging.getLogger("musegl.engine")


@attrs.define
class InFlight:
    """A step launched on an asynchronous executor, not committed yet."""

    scheduled: ScheduledStep
    pending: PendingStep
    started: float


@attrs.define(eq=False)
class StepLoop:
    """Runs the engine's steps (see the module docstring). The engine owns the
    requests: ``embed(seq, index)`` gives an image's embedding rows,
    ``on_prefilled(seq)`` and ``on_token(seq, token, logprobs)`` take a step's
    committed output, ``fail(seq, error)`` ends a request that cannot go on."""

    executor: Executor
    speculator: Speculator
    scheduler: Scheduler
    max_context: int
    clock: Callable[[], float]
    step_book: StepBook
    prefill_budget: PrefillBudget
    throughput: ThroughputLog
    embed: Callable[[SequenceState, int], Any]
    on_prefilled: Callable[[SequenceState], None]
    on_token: TokenFn
    fail: Callable[[SequenceState, errors.EngineError], None]
    verify_rows: int | None = None  # the verify-rows budget of a step (None: none), see draft_cap
    trace: Trace | None = None  # the step timeline (``--trace-steps``)
    gate: LaunchGate | None = None  # closed while a step is launched on an asynchronous executor
    steps: int = 0
    budget_cut_steps: int = 0  # steps whose drafts the budget shortened (some still drafted)
    budget_skipped_steps: int = 0  # steps the budget left without drafts
    steps_ahead: int = 0  # steps launched before the previous one was read
    discarded_rows: int = 0  # their rows whose sequence had stopped
    inflight: InFlight | None = None  # a launched step not committed yet
    _async: bool = attrs.field(init=False)
    # drafts may stay on the device: the speculator leaves them there, the executor reads them
    _device_drafts: bool = attrs.field(init=False)
    _on_device: DeviceDrafts | None = None  # this step's drafts, while they are on the device
    _last_result: float = 0.0  # when the last launched step's result arrived
    _gated: bool = attrs.field(init=False)  # launches close the gate (a device computes them, not the host)

    def __attrs_post_init__(self) -> None:
        limits = self.executor.limits
        self._async = limits.async_steps
        self._device_drafts = limits.device_drafts and proposes_on_device(self.speculator)
        self._gated = self.gate is not None and limits.async_steps and not limits.host_compute

    # -- one forward -----------------------------------------------------------------
    def step(self) -> None:
        if self.inflight is not None:  # a launched step: launch the next one, then commit it
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
            self.inflight = InFlight(scheduled, pending, started)
            return
        try:
            self._copy_blocks(copies)
            try:
                if self._gated:  # launch with the gate closed, then wait
                    with self.gate.launching():
                        pending = self.executor.launch(step)  # type: ignore[attr-defined]
                    output = pending.result()
                else:
                    output = self.executor.step(step)
            finally:  # no mask computation of this step outlives it
                for chunk in step.chunks:
                    if isinstance(chunk.masks, PendingMasks):
                        chunk.masks.wait()
            self._check_output(scheduled, output)
        except Exception as exc:  # an executor failure fails this batch, not the worker
            self._failed(plan, exc)
            return
        self._record(plan, self.clock() - started)
        self._update(scheduled, output)

    def draft_cap(self, decoders: int) -> int:
        """The most drafts each sequence may get in a step that decodes ``decoders``
        sequences: ``verify_rows // decoders - 1`` under a budget (every decoding
        sequence's block is its pending row plus its drafts, so the step's verify rows
        stay within the budget), 0 when that is below 1 (a plain decode step), the
        speculator's ``max_draft`` without a budget. ``decoders`` counts every
        sequence the step decodes, with drafts or not: each takes at least one row."""
        most = self.speculator.max_draft
        if self.verify_rows is None or decoders < 1:
            return most
        return max(0, min(most, self.verify_rows // decoders - 1))

    def _propose_drafts(self) -> None:
        """Ask the speculator for drafts for the sequences the next step decodes,
        at most :meth:`draft_cap` each."""
        self._on_device = None  # drafts of a step that was never planned are not this step's
        if not self.speculator.max_draft:
            return
        decoders = self.scheduler.decoders()
        cap = self.draft_cap(len(decoders))
        requests = []
        capped = False
        for seq in decoders:
            room = min(
                self.speculator.max_draft,
                seq.max_new - len(seq.generated) - 1,  # the block commits up to drafts + 1 tokens
                self.max_context - len(seq.tokens),  # the last draft sits at position len(tokens)
            )
            capped |= room > cap
            room = min(room, cap)
            seq.drafts = []
            if room > 0:
                requests.append(DraftRequest(seq.handle, tuple(seq.tokens), tuple(seq.blocks), room))
        if capped:  # the budget, not the sequences' own limits, took drafts from this step
            if cap > 0:
                self.budget_cut_steps += 1
            else:
                self.budget_skipped_steps += 1
        if not requests:
            return
        by_handle = {r.seq: r for r in requests}
        if self._device_drafts and all(self._host_free(seq) for seq in decoders if seq.handle in by_handle):
            found = self.speculator.propose_on_device(requests)  # type: ignore[attr-defined]
            self._on_device = found
            proposed = {seq: [0] * count for seq, count in found.counts.items()}  # placeholders
        else:
            proposed = self.speculator.propose(requests)
        for seq in decoders:
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

    def _place_device_drafts(self, step) -> None:
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
        an image the executor cannot encode fails its own request (``ImageEncodingFailed``) and nothing
        else, and planning never stops halfway through (block copies promised)."""
        for seq in list(self.scheduler.running):
            if seq.phase is not Phase.PREFILL or not seq.request.images:
                continue
            try:
                for index, placed in enumerate(seq.request.images):
                    if placed.start + placed.image.rows > seq.computed:  # rows a cached prefix does not cover
                        self.embed(seq, index)
            except Exception as exc:
                log.exception("image encoding failed")
                self.fail(seq, errors.ImageEncodingFailed(str(exc)))

    # -- asynchronous steps ------------------------------------------------------------
    @staticmethod
    def _followable(seq: SequenceState) -> bool:
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
        current, self.inflight = self.inflight, None
        ahead = self._launch_ahead(current)
        try:
            output = current.pending.result()
            self._check_output(current.scheduled, output)
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
            self.inflight = ahead
            return
        try:  # every sequence of the launched step stopped at N: nothing of it is needed
            ahead.pending.result()
        except Exception:
            log.exception("a discarded step failed")

    def _launch_ahead(self, current: InFlight) -> InFlight | None:
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

    # -- running and committing a step -------------------------------------------------
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            self.executor.copy_blocks(copies)
            self.speculator.copy_blocks(copies)

    @staticmethod
    def _check_output(scheduled: ScheduledStep, output: StepOutput) -> None:
        for chunk in scheduled.step.chunks:
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
            self.fail(seq, errors.ExecutionFailed(str(exc)))

    def _record(self, plan: list[tuple[SequenceState, int]], seconds: float) -> None:
        self.steps += 1
        kind = StepBook.kind(plan)
        self.step_book.record(kind, seconds)
        self.prefill_budget.observe(kind[1], kind[2], seconds)
        if self.trace is not None:
            running = self.scheduler.running
            self.trace.step(*kind, seconds, len(running), sum(seq.phase is Phase.PREFILL for seq in running))

    def _update(self, scheduled: ScheduledStep, output: StepOutput) -> None:
        """The scheduler commits the step (:meth:`Scheduler.update`); the speculator sees what was kept."""
        update = self.scheduler.update(scheduled, output, self.on_prefilled, self.on_token)
        self.throughput.prompt += update.prompt_rows
        self.speculator.observe(scheduled.step, output, update.committed_rows)

"""The engine loop: admits prepared requests, runs executor steps, emits events.

One engine thread owns the executor. Other threads talk to it only through
:meth:`Engine.submit` and :meth:`Engine.cancel`, which enqueue commands; the
loop applies them between steps, so a cancellation takes effect within one
step. Events (:mod:`musegl_core.worker.messages`) go to the ``emit`` callback.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import attrs

from musegl_core.engine.detokenize import IncrementalDetokenizer
from musegl_core.engine.executor import Executor
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.request import Phase, PreparedRequest, SequenceState
from musegl_core.engine.scheduler import Scheduler, SchedulerLimits
from musegl_core.engine.stops import StopMatcher
from musegl_core.errors import ApiError
from musegl_core.worker import messages as m

log = logging.getLogger("musegl.engine")


@attrs.frozen
class EngineConfig:
    max_context: int = 8192
    max_inflight_requests: int = 4
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    kv_blocks: int | None = None

    def pool_blocks(self, block_size: int) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        per_request = -(-self.max_context // block_size)
        return per_request * self.max_inflight_requests


def context_error(prompt_tokens: int, reservation: int, max_context: int) -> ApiError:
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
            "source": "worker",
        },
    )


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
        limits = executor.limits
        max_step = min(limits.max_step_tokens, config.max_decode_sequences + config.max_prefill_chunk)
        self.scheduler = Scheduler(
            self.pool,
            SchedulerLimits(config.max_decode_sequences, config.max_prefill_chunk, max_step),
        )
        self.end_ids = frozenset(tokenizer.end_of_generation_ids)
        self._inbox: queue.Queue = queue.Queue()
        self._by_id: dict[str, SequenceState] = {}
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
                seq = self._by_id.get(arg)
                if seq is not None:
                    self._finish(seq, "cancelled", None)
            elif kind == "stop":
                self._stopping = True
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail(self, request_id: str, error: ApiError) -> None:
        self.emit(
            m.Failed(request_id, error.status, error.message, error.type, error.code, error.param, dict(error.metadata))
        )

    def _admit(self, request: PreparedRequest) -> None:
        config = self.config
        if request.id in self._by_id:
            self._fail(request.id, ApiError(400, f"duplicate request id {request.id}"))
            return
        prompt = len(request.prompt_ids)
        reservation = request.max_tokens or 1
        if prompt + reservation > config.max_context:
            self._fail(request.id, context_error(prompt, reservation, config.max_context))
            return
        if len(self._by_id) >= config.max_inflight_requests:
            self._fail(
                request.id,
                ApiError(503, "the server is busy; retry shortly", "unavailable_error", "server_busy", retry_after=1),
            )
            return
        max_new = min(request.max_tokens or config.max_context, config.max_context - prompt)
        # Reserve every block the request can grow into, so no step fails for lack of KV.
        blocks = self.pool.blocks_for(prompt + max_new)
        try:
            self.pool.reserve(blocks)
        except Exception:
            self._fail(
                request.id,
                ApiError(503, "no KV cache space is free; retry shortly", "unavailable_error", "server_busy", retry_after=1),
            )
            return
        seq = SequenceState(
            request=request,
            handle=self._next_handle,
            max_new=max_new,
            tokens=list(request.prompt_ids),
            reserved=blocks,
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopMatcher(request.stop, request.template_stops),
        )
        self._next_handle += 1
        self._by_id[request.id] = seq
        self.scheduler.add(seq)

    # -- one forward -----------------------------------------------------------------
    def step(self) -> None:
        planned = self.scheduler.schedule()
        if planned is None:
            return
        step, plan = planned
        try:
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
            self._on_token(seq, output.tokens[seq.handle])

    def _on_token(self, seq: SequenceState, token: int) -> None:
        request = seq.request
        if not seq.started:
            seq.started = True
            self.emit(m.Started(seq.id, seq.prompt_len, 0))
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
        if seq.phase is Phase.FINISHED:
            return
        seq.phase = Phase.FINISHED
        self.scheduler.remove(seq)
        self.executor.release_sequence(seq.handle)
        self._by_id.pop(seq.id, None)
        if reason is None:
            return
        self.emit(
            m.Done(
                seq.id,
                reason,
                matched_stop,
                seq.prompt_len,
                len(seq.generated),
                0,
                None if matched_stop is not None else tuple(seq.generated),
            )
        )

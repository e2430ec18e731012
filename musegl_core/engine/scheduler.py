"""Continuous batching: which rows go into the next forward.

Every step decodes the running sequences (at most ``max_decode_sequences``,
rotating fairly when more are running) and spends the rest of the step on
chunked prefill: at most ``max_prefill_chunk`` prompt positions per forward,
shared first-come first-served among prefilling sequences. Decoders therefore
keep their cadence while a long prompt prefills, and a long prompt advances
by a chunk every step while others decode. Requests join and leave between
steps.
"""

from __future__ import annotations

import attrs

from musegl_core.engine.executor import SeqChunk, Step
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.request import Phase, SequenceState


@attrs.frozen
class SchedulerLimits:
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    max_step_tokens: int = 4096


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits):
        self.pool = pool
        self.limits = limits
        self.running: list[SequenceState] = []

    # -- membership ------------------------------------------------------------------
    def add(self, seq: SequenceState) -> None:
        self.running.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """Take ``seq`` out of the batch and return all its KV to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks.clear()
        if seq.reserved:
            self.pool.unreserve(seq.reserved)
            seq.reserved = 0

    @property
    def idle(self) -> bool:
        return not self.running

    # -- step planning ---------------------------------------------------------------
    def _ensure_blocks(self, seq: SequenceState, upto: int) -> None:
        """Make the block table cover positions ``0 .. upto-1``."""
        need = self.pool.blocks_for(upto) - len(seq.blocks)
        for _ in range(need):
            from_reservation = seq.reserved > 0
            seq.blocks.append(self.pool.allocate(reserved=from_reservation))
            if from_reservation:
                seq.reserved -= 1

    def _chunk(self, seq: SequenceState, count: int, sample: bool) -> SeqChunk:
        start = seq.computed
        self._ensure_blocks(seq, start + count)
        return SeqChunk(
            seq=seq.handle,
            tokens=seq.tokens[start : start + count],
            positions=list(range(start, start + count)),
            blocks=list(seq.blocks),
            sample=sample,
            sampling=seq.request.sampling,
        )

    def schedule(self) -> tuple[Step, list[tuple[SequenceState, int]]] | None:
        """Plan the next forward; returns the step and (sequence, rows) pairs."""
        limits = self.limits
        budget = limits.max_step_tokens
        plan: list[tuple[SequenceState, int]] = []
        chunks: list[SeqChunk] = []

        decoders = [s for s in self.running if s.phase is Phase.DECODE]
        # Fair rotation when more sequences decode than one step may carry.
        decoders.sort(key=lambda s: s.decode_turns)
        for seq in decoders[: min(limits.max_decode_sequences, budget)]:
            chunks.append(self._chunk(seq, 1, sample=True))
            plan.append((seq, 1))
            seq.decode_turns += 1
            budget -= 1

        prefill_budget = min(limits.max_prefill_chunk, budget)
        for seq in self.running:
            if prefill_budget <= 0:
                break
            if seq.phase is not Phase.PREFILL:
                continue
            remaining = len(seq.tokens) - seq.computed
            count = min(remaining, prefill_budget)
            chunks.append(self._chunk(seq, count, sample=count == remaining))
            plan.append((seq, count))
            prefill_budget -= count
        if not chunks:
            return None
        return Step(chunks=chunks), plan

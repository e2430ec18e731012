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
        """Take ``seq`` out of the batch (its blocks belong to its session)."""
        if seq in self.running:
            self.running.remove(seq)

    @property
    def idle(self) -> bool:
        return not self.running

    # -- step planning ---------------------------------------------------------------
    def _prepare_blocks(self, seq: SequenceState, start: int, end: int, copies: list) -> None:
        """Make the block table cover positions ``start .. end-1`` for writing:
        new blocks come from the session's slot; a block shared with a snapshot
        or another session, or keyed by the prefix cache, is copied first
        (copy-on-write)."""
        slot = seq.session.slot
        size = self.pool.block_size
        for index in range(start // size, min(len(slot.blocks), self.pool.blocks_for(end))):
            if self.pool.immutable(slot.blocks[index]):  # shared, or keyed by the prefix cache
                pair = slot.copy_on_write(index)
                if pair is not None:
                    copies.append(pair)
        while len(slot.blocks) < self.pool.blocks_for(end):
            slot.blocks.append(slot.take_block())

    def _chunk(self, seq: SequenceState, count: int, sample: bool, copies: list) -> SeqChunk:
        start = seq.computed
        self._prepare_blocks(seq, start, start + count, copies)
        return SeqChunk(
            seq=seq.handle,
            tokens=seq.tokens[start : start + count],
            positions=list(range(start, start + count)),
            blocks=list(seq.blocks),
            sample=sample,
            sampling=seq.request.sampling,
        )

    def schedule(self) -> tuple[Step, list[tuple[SequenceState, int]], list[tuple[int, int]]] | None:
        """Plan the next forward: the step, (sequence, rows) pairs, and the
        (src, dst) block copies to make before it runs."""
        limits = self.limits
        budget = limits.max_step_tokens
        plan: list[tuple[SequenceState, int]] = []
        chunks: list[SeqChunk] = []
        copies: list[tuple[int, int]] = []

        decoders = [s for s in self.running if s.phase is Phase.DECODE]
        # Fair rotation when more sequences decode than one step may carry.
        decoders.sort(key=lambda s: s.decode_turns)
        for seq in decoders[: min(limits.max_decode_sequences, budget)]:
            chunks.append(self._chunk(seq, 1, sample=True, copies=copies))
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
            chunks.append(self._chunk(seq, count, sample=count == remaining, copies=copies))
            plan.append((seq, count))
            prefill_budget -= count
        if not chunks:
            return None
        return Step(chunks=chunks), plan, copies

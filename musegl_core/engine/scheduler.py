"""Continuous batching: which rows go into the next forward.

Every step decodes the running sequences (at most ``max_decode_sequences``,
rotating fairly when more are running) and spends the rest of the step on
chunked prefill: at most ``max_prefill_chunk`` prompt positions per forward,
fewer while sequences decode when a :class:`~musegl_core.engine.prefill_budget.PrefillBudget`
bounds how much prefill may stretch their step, shared first-come first-served
among prefilling sequences. Decoders therefore keep their cadence while a long
prompt prefills, and a long prompt advances by a chunk every step while others
decode. Requests join and leave between steps.

A decoding sequence with drafts (``SequenceState.drafts``, from a speculator)
sends its pending token and the drafts as one chunk that samples after every
row. A step that only decodes is padded up to the executor's next
``step_sizes`` width (``Step.width``), so a backend can replay a graph
captured for that width.

The scheduler also fills in what the executor's sampler needs per sampled
row: the position-keyed random number, the processors' masks (computed by
:class:`~musegl_core.engine.masks.MaskWorkers` while the forward runs, or
inline with ``mask_threads=0``), the penalty history, and the embedding rows
of images the chunk covers.

The scheduler owns the running sequences (:meth:`Scheduler.add`,
:meth:`Scheduler.remove`, ``by_id``) and hears what each step did: the engine
plans with :meth:`Scheduler.schedule`, has the executor run the step, and hands
the output back to :meth:`Scheduler.update`, which commits it (prefill
progress, the sampled ids the drafts agree with, blocks that held only
rejected drafts) and passes every committed id to the engine's output pipeline.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import attrs

from musegl_core.engine.executor import EmbeddingSpan, ExecutorLimits, SeqChunk, Step, StepOutput, TokenLogprobs
from musegl_core.engine.kv_pool import KVPool
from musegl_core.engine.kv_suspend import OnDemand, runnable
from musegl_core.engine.masks import MaskClock, MaskWorkers
from musegl_core.engine.prefill_budget import PrefillBudget
from musegl_core.engine.prefill_sharing import PrefillSharing
from musegl_core.engine.randomness import uniform
from musegl_core.engine.request import Phase, SequenceState
from musegl_core.engine.speculator import accept


@attrs.frozen
class SchedulerLimits:
    max_decode_sequences: int = 4
    max_prefill_chunk: int = 512
    max_step_tokens: int = 4096
    step_sizes: tuple[int, ...] = ()
    #: prompt rows of a step in which one sequence prefills and nothing else runs, at least
    #: max_prefill_chunk (the engine's solo_prefill_chunk); None: max_prefill_chunk
    solo_prefill_chunk: int | None = None

    @property
    def executor(self) -> ExecutorLimits:
        return ExecutorLimits(self.max_step_tokens, self.step_sizes)


#: ``embed(seq, placed_image_index)`` returns the image's embedding rows (computed once per request).
EmbedFn = Callable[[SequenceState, int], Any]

#: ``on_token(seq, token, logprobs)``: one committed id, through stops, detokenization and the end
TokenFn = Callable[[SequenceState, int, "TokenLogprobs | None"], None]


class ScheduledStep(NamedTuple):
    """A planned forward: the executor's step, the (sequence, rows) it carries, and
    the (src, dst) block copies to make before it runs."""

    step: Step
    plan: list[tuple[SequenceState, int]]
    copies: list[tuple[int, int]]


@attrs.frozen
class StepUpdate:
    """What :meth:`Scheduler.update` committed of a step."""

    #: rows per sequence handle that are now part of the cache (what the speculator observes)
    committed_rows: dict[int, int]
    prompt_rows: int  # prompt positions prefilled


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits, embed: EmbedFn | None = None,
                 taps: tuple[int, ...] = (), mask_threads: int = 0, budget: PrefillBudget | None = None,
                 sharing: PrefillSharing | None = None, window: int | None = None):
        self.pool = pool
        #: with sliding pages (``pool.companions``): the sliding layers' window; blocks a running
        #: sequence's window left give their sliding pages back (:meth:`_trim_window`)
        self.window = window
        #: called as ``window_down(session, [(index, block), ...])`` before those blocks give their sliding
        #: pages back: the host tier keeps a copy for rewinds (SessionTable.window_down; None: none)
        self.window_down = None
        self.limits = limits
        #: prompt rows per step while sequences decode (None: always ``max_prefill_chunk``)
        self.budget = budget
        #: prompts that wait for the blocks an earlier prompt computes (None: off, no prefix cache)
        self.sharing = sharing
        self.embed = embed
        self.taps = taps
        self.running: list[SequenceState] = []
        #: the running sequences by request id (the same sequences as ``running``)
        self.by_id: dict[str, SequenceState] = {}
        self.drafted_tokens = 0  # drafts the committed steps carried, and how many of them were accepted
        self.accepted_tokens = 0
        self.verify_blocks = 0  # decode chunks that carried drafts
        #: rows of window recomputations committed (rewinds past the sliding layers' window)
        self.window_rows = 0
        self.mask_clock = MaskClock()
        #: grammar masks computed while the forward runs (None: inline, here)
        self.mask_workers = MaskWorkers(mask_threads, self.mask_clock) if mask_threads > 0 else None
        #: blocks on demand for running sequences, suspended to the host tier under pressure
        #: (engine/kv_suspend.py; the engine sets it where the host tier is on); None: each running
        #: sequence reserved its blocks to its end at admission
        self.on_demand: OnDemand | None = None
        self._ahead = False  # planning a step ahead (schedule_ahead): no room is made, nobody suspended

    # -- membership ------------------------------------------------------------------
    def add(self, seq: SequenceState) -> None:
        self.running.append(seq)
        self.by_id[seq.id] = seq

    def remove(self, seq: SequenceState) -> None:
        """Take ``seq`` out of the batch (its blocks belong to its session)."""
        if seq in self.running:
            self.running.remove(seq)
        if self.by_id.get(seq.id) is seq:
            del self.by_id[seq.id]
        if self.sharing is not None:
            self.sharing.forget(seq)

    @property
    def idle(self) -> bool:
        return not self.running

    def decoders(self) -> list[SequenceState]:
        """The decoding sequences the next step will carry (fair rotation)."""
        decoders = [s for s in runnable(self.running, self.on_demand) if s.phase is Phase.DECODE]
        decoders.sort(key=lambda s: s.decode_turns)
        return decoders[: min(self.limits.max_decode_sequences, self.limits.max_step_tokens)]

    # -- step planning ---------------------------------------------------------------
    def _prepare_blocks(self, seq: SequenceState, start: int, end: int, copies: list) -> None:
        """Make the block table cover positions ``start .. end-1`` for writing:
        new blocks come from the session's slot; a block shared with a snapshot
        or another session, or keyed by the prefix cache, is copied first
        (copy-on-write). A window recomputation (``end <= seq.rewound``) writes no
        block: its rows' sliding K/V go to the slot's own pages (:meth:`Slot.window_pages_of`)."""
        slot = seq.session.slot
        size = self.pool.block_size
        if end <= seq.rewound:
            for index in range(start // size, self.pool.blocks_for(end)):
                slot.window_pages_of(index)
            return
        for index in range(start // size, min(len(slot.blocks), self.pool.blocks_for(end))):
            if self.pool.immutable(slot.blocks[index]):  # shared, or keyed by the prefix cache
                copies.extend(slot.copy_on_write(index))
        while len(slot.blocks) < self.pool.blocks_for(end):
            slot.blocks.append(slot.take_block())

    def _embeds(self, seq: SequenceState, start: int, count: int) -> list[EmbeddingSpan]:
        spans = []
        for index, placed in enumerate(seq.request.images):
            lo, hi = max(start, placed.start), min(start + count, placed.start + placed.image.rows)
            if lo < hi:
                if self.embed is None:
                    raise RuntimeError("a prompt with images needs an embed function")
                spans.append(EmbeddingSpan(lo - start, hi - lo, self.embed(seq, index), lo - placed.start))
        return spans

    def _chunk(self, seq: SequenceState, count: int, sample: int, copies: list, drafts=()) -> SeqChunk:
        """The next ``count`` rows of ``seq`` (its pending rows, then ``drafts``)."""
        start = seq.computed
        self._prepare_blocks(seq, start, start + count, copies)
        request = seq.request
        tokens = seq.tokens[start : start + count - len(drafts)] + list(drafts)
        params = request.sampling
        first_sampled = count - sample
        uniforms = [uniform(params.seed or 0, start + first_sampled + j + 1)  # keyed by the drawn position
                    for j in range(sample)]
        masks: Any = ()
        if request.processors and sample:
            # row j's mask follows the generated ids and the drafts before row j
            befores = [tokens[count - sample + 1 : first_sampled + j + 1] for j in range(sample)]
            if self.mask_workers is None:
                started = time.perf_counter()
                masks = [self._mask(seq.request.processors, seq.generated, b) for b in befores]
                spent = time.perf_counter() - started
                self.mask_clock.add(compute=spent, blocked=spent)
            else:
                generated = list(seq.generated)  # a snapshot: the task runs while the engine goes on
                processors = request.processors
                masks = self.mask_workers.submit(
                    lambda: [self._mask(processors, generated, b) for b in befores], sample)
        return SeqChunk(
            seq=seq.handle,
            tokens=tokens,
            positions=list(range(start, start + count)),
            blocks=list(seq.blocks),
            sliding_blocks=self._sliding_tables(seq.session.slot) if self.pool.companions else (),
            keep_full=start + count <= seq.rewound,
            sample=sample,
            sampling=params,
            uniforms=uniforms,
            masks=masks,
            history=seq.tokens[:start] if params.penalized and sample else (),
            prompt_len=seq.prompt_len,
            logprobs=request.logprobs if sample else -1,
            embeds=self._embeds(seq, start, count) if request.images else (),
        )

    def _sliding_tables(self, slot) -> tuple[list[int], ...]:
        """Each group of sliding layers' block table: the page of each block, -1 where the
        block's sliding pages went back to the pool (no row's window reaches it); during a
        window recomputation, the slot's own pages of the blocks it recomputes."""
        own = slot.window_pages
        pages = [own.get(i) or self.pool.companion_pages(b) for i, b in enumerate(slot.blocks)]
        return tuple([p[group] if p is not None else -1 for p in pages] for group in range(self.pool.companions))

    def _trim_window(self, seq: SequenceState) -> None:
        """Sliding pages: give back the sliding pages of the blocks ``seq`` alone holds that lie
        wholly before the window of its next position (the keys of ``computed - window + 1``
        onwards are the oldest any later row of a sliding layer reads)."""
        slot = seq.session.slot
        size = self.pool.block_size
        end = min(len(slot.blocks), max(0, seq.computed - self.window) // size)
        if slot.window_pages:  # a window recomputation: its own pages out of the window go back
            if seq.computed >= seq.rewound:  # done: the exact ones become their blocks' sliding pages
                slot.end_window_pages(max(0, seq.rewound - self.window) // size)
            else:
                slot.drop_window_pages(end)
        leaving = [(index, block) for index, block in enumerate(slot.blocks[:end])
                   if self.pool.refcount(block) == 1 and self.pool.has_window(block)]
        if leaving and self.window_down is not None:
            self.window_down(seq.session, leaving)
        for _, block in leaving:
            self.pool.drop_companions(block)

    @staticmethod
    def _mask(processors, generated: list[int], drafts_before: list[int]) -> Any:
        """The AND of the processors' masks for the next token after ``drafts_before``."""
        generated = generated + list(drafts_before) if drafts_before else generated
        combined = None
        for processor in processors:
            mask = processor.mask(generated)
            if mask is not None:
                combined = mask if combined is None else combined & mask
        return combined

    def schedule(self) -> ScheduledStep | None:
        """Plan the next forward: the step, (sequence, rows) pairs, and the
        (src, dst) block copies to make before it runs. With blocks on demand
        (:attr:`on_demand`), suspended sequences that have room come back first, and
        each sequence the step carries takes the blocks it grows into
        (:meth:`_secure`), or skips the step."""
        limits = self.limits
        budget = limits.max_step_tokens
        # (sequence, rows, sampled rows, drafts): what the step carries, before blocks are secured
        picks: list[tuple[SequenceState, int, int, list[int]]] = []
        copies: list[tuple[int, int]] = []
        if self.on_demand is not None and not self._ahead:
            self.on_demand.resume(self.running)

        for seq in self.decoders():
            if budget < 1:
                break
            drafts = seq.drafts[: budget - 1]
            seq.drafts = drafts
            rows = 1 + len(drafts)
            picks.append((seq, rows, rows, drafts))
            budget -= rows

        decoding = len(picks)
        prefill_budget = min(limits.max_prefill_chunk, budget)
        prefilling = [seq for seq in runnable(self.running, self.on_demand) if seq.phase is Phase.PREFILL]
        if self.sharing is not None and prefilling:
            prefilling = self.sharing.ready(prefilling)  # followers wait for their leaders' blocks
        if self.budget is not None and prefilling:
            prefill_budget = min(prefill_budget, self.budget.rows(decoding=decoding, prefilling=len(prefilling)))
        if not decoding and len(self.running) == 1 and prefilling and limits.solo_prefill_chunk:
            # one sequence prefills and nothing else runs: no one waits on this step
            prefill_budget = min(limits.solo_prefill_chunk, budget)
        for seq in prefilling:
            if prefill_budget <= 0:
                break
            if seq.computed < seq.rewound:  # a window recomputation: its chunks stop where the cache resumes
                count = min(seq.rewound - seq.computed, prefill_budget)
                picks.append((seq, count, 0, []))
                prefill_budget -= count
                continue
            remaining = len(seq.tokens) - seq.computed
            count = min(remaining, prefill_budget)
            picks.append((seq, count, int(count == remaining), []))
            prefill_budget -= count
        if self.on_demand is not None:
            picks = self._secure(picks)
            if picks is None:
                return None

        plan: list[tuple[SequenceState, int]] = []
        chunks: list[SeqChunk] = []
        for seq, rows, sample, drafts in picks:
            chunks.append(self._chunk(seq, rows, sample=sample, copies=copies, drafts=drafts))
            plan.append((seq, rows))
            if seq.phase is Phase.DECODE:
                seq.decode_turns += 1
        if not chunks:
            return None
        step = Step(chunks=chunks, taps=self.taps)
        if limits.step_sizes and step.decode_only:
            step.width = limits.executor.padded_width(step.num_tokens)
        return ScheduledStep(step, plan, copies)

    def _secure(self, picks: list) -> list | None:
        """Blocks on demand: each picked sequence, the first admitted first, takes the blocks its
        rows grow into (engine/kv_suspend.py: idle holders make room, then lower-priority running
        sequences are suspended); a sequence that finds none, or was suspended meanwhile, skips
        the step. Planning ahead (:meth:`schedule_ahead`) makes no room: None when any lacks."""
        on_demand = self.on_demand
        skipped: set[int] = set()
        for seq, rows, _sample, _drafts in sorted(picks, key=lambda p: p[0].handle):
            if on_demand.is_suspended(seq):
                skipped.add(seq.handle)
                continue
            need = on_demand.need(seq, seq.computed, seq.computed + rows)
            if not on_demand.secure(seq, need, self.running, suspend=not self._ahead):
                if self._ahead:
                    return None
                skipped.add(seq.handle)
                if seq.phase is Phase.DECODE:  # its turn is spent: the rotation moves on to the others
                    seq.decode_turns += 1
        return [pick for pick in picks
                if pick[0].handle not in skipped and not on_demand.is_suspended(pick[0])]

    def schedule_ahead(self) -> ScheduledStep | None:
        """Plan step N+1 while step N is in flight: as if N's sampled id had arrived
        for every running sequence (every one decodes in N). Its chunks follow N's
        ids on the device (``SeqChunk.follows``)."""
        running = list(self.running)
        for seq in running:
            seq.tokens.append(0)
            seq.computed += 1
        self._ahead = True
        try:
            planned = self.schedule()
        finally:
            self._ahead = False
            for seq in running:
                seq.tokens.pop()
                seq.computed -= 1
        if planned is None:
            return None
        for chunk in planned.step.chunks:
            chunk.follows = True
        return planned

    # -- committing a step -----------------------------------------------------------
    def update(self, scheduled: ScheduledStep, output: StepOutput,
               on_prefilled: Callable[[SequenceState], None], on_token: TokenFn) -> StepUpdate:
        """Commit a step's output: prefill progress, then the sampled ids the drafts
        agree with (all of them without drafts; ``StepOutput.accepted`` when the
        executor compared drafts on the device), fed one by one to ``on_token``
        exactly as if they had been decoded one per step; ``on_prefilled(seq)``
        when a prompt is done, before its first id. A sequence that ends (or was
        cancelled, or stopped before a step launched ahead) takes nothing more."""
        committed_rows: dict[int, int] = {}
        prompt_rows = 0
        for seq, rows in scheduled.plan:
            if seq.phase is Phase.FINISHED:
                continue
            sampled = output.tokens.get(seq.handle)
            if seq.phase is Phase.PREFILL:
                recomputed = seq.computed < seq.rewound  # a window recomputation: the rows were cached
                if recomputed:
                    self.window_rows += rows
                seq.computed += rows
                prompt_rows += rows
                if not recomputed:  # a speculator observed them when they were computed
                    committed_rows[seq.handle] = rows
                if not sampled:  # a prefill chunk that did not reach the end of the prompt
                    if self.sharing is not None:
                        self.sharing.computed(seq)  # its followers adopt the full blocks next step
                    continue
                seq.phase = Phase.DECODE
                on_prefilled(seq)
                logprobs = output.logprobs.get(seq.handle) or [None]
                on_token(seq, sampled[-1], logprobs[-1])
                continue
            drafts, seq.drafts = seq.drafts, []
            if seq.handle in output.accepted:  # drafts on the device: the executor compared them
                committed = list(sampled[:output.accepted[seq.handle] + 1])
            else:
                committed = accept(drafts, sampled) if drafts else list(sampled[-1:])
            self.drafted_tokens += len(drafts)
            self.accepted_tokens += len(committed) - 1
            self.verify_blocks += bool(drafts)
            seq.drafted += len(drafts)
            seq.accepted += len(committed) - 1
            committed_rows[seq.handle] = self._commit(seq, committed, output.logprobs.get(seq.handle, []), on_token)
            if seq.phase is not Phase.FINISHED and drafts:
                self._trim_blocks(seq)
        if self.pool.companions:
            for seq, _rows in scheduled.plan:
                if seq.session.slot.blocks:
                    self._trim_window(seq)
        return StepUpdate(committed_rows, prompt_rows)

    @staticmethod
    def _commit(seq: SequenceState, tokens: list[int], logprobs: list[TokenLogprobs], on_token: TokenFn) -> int:
        """Feed a decode step's committed tokens one by one: each makes the row that
        preceded it (the pending token, then each accepted draft) part of the cache.
        Stops at the token that ends the sequence. Returns the rows kept."""
        kept = 0
        for i, token in enumerate(tokens):
            if seq.phase is Phase.FINISHED:
                break
            seq.computed += 1
            kept += 1
            on_token(seq, token, logprobs[i] if i < len(logprobs) else None)
        return kept

    def _trim_blocks(self, seq: SequenceState) -> None:
        """Give back blocks that only held rejected draft rows."""
        keep = self.pool.blocks_for(seq.computed + 1)
        if len(seq.blocks) > keep:
            seq.session.slot.truncate(keep)

"""Launched steps: what :meth:`TorchExecutor.launch` returns before the device is done.

A launch queues the step's device work (the staging copies, the graph or the
eager kernels, the sampler) and the copy of its answer into pinned host
memory, and returns one of these. ``result()`` waits for that copy (an
event, not the whole stream: a step launched behind it keeps running) and
packs the answer per sequence, once.

A chunk that :attr:`~musegl_core.engine.executor.SeqChunk.follows` the
previous launch takes that launch's id for its sequence: on the device,
where the previous launch was a graph step of one row per sequence (its ids
stay in the graphs' ``last_ids``, row ``device_rows[seq]``); otherwise from
the previous launch's result (:func:`follow_on_host`, which waits for it).
"""

from __future__ import annotations

from typing import Sequence

import attrs

from musegl_core.engine.executor import HeadRows, PendingStep, SeqChunk, Step, StepOutput
from musegl_cuda.sampling import Draw


class Launched:
    """A launched step whose answer is read once, on the first :meth:`result`.
    ``device_rows`` maps a sequence to the row of the graphs' ``last_ids`` that
    holds its id (None: its ids are only in the result)."""

    device_rows: dict[int, int] | None = None
    #: the step's sampled ids on the device, per packed row (``ids_by_row``) or in
    #: sampled-row order; None where they are not one tensor
    device_ids = None
    ids_by_row = True
    #: the accepted counts of its device-draft blocks (:mod:`musegl_cuda.drafts`), if any
    judged = None
    _output: StepOutput | None = None
    _error: BaseException | None = None

    def _read(self) -> StepOutput:
        raise NotImplementedError

    def result(self) -> StepOutput:
        if self._output is None and self._error is None:
            try:
                output = self._read()
                if self.judged is not None:
                    output.accepted = self.judged.values(output)
                self._output = output
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output

    def settle(self) -> None:
        """Read the answer now (the host buffers it sits in are about to be reused);
        a failure is kept for :meth:`result`."""
        try:
            self.result()
        except BaseException:
            pass


class GreedyIds(Launched):
    """A graph step whose every row is plain greedy: the graph's argmax ids, copied
    into one of the graphs' pinned buffers. ``starts`` (None: row ``i`` is chunk
    ``i``'s only row) gives each chunk's first row. ``hidden``: the step's tapped
    rows ``(taps, rows, hidden)`` on the device (None: no taps asked)."""

    def __init__(self, chunks: Sequence[SeqChunk], fetched: tuple, rows: dict[int, int] | None,
                 starts: Sequence[int] | None = None, hidden=None, device_ids=None) -> None:
        self.chunks = chunks
        self.device_ids = device_ids
        self.host, self.event = fetched
        self.device_rows = rows
        self.starts = starts
        self.hidden = hidden

    def _read(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        chunks = self.chunks
        starts = range(len(chunks)) if self.starts is None else self.starts
        ids = self.host[:starts[-1] + len(chunks[-1].tokens)].tolist()
        out = StepOutput(tokens={ch.seq: ids[s:s + len(ch.tokens)] for ch, s in zip(chunks, starts)})
        if self.hidden is not None:
            out.hidden = {ch.seq: self.hidden[:, s:s + len(ch.tokens)] for ch, s in zip(chunks, starts)}
        return out


class Sampled(Launched):
    """A step whose sampled rows went through the sampler (:class:`Draw`), and whose
    logits rows and tapped hidden states stay on the device."""

    def __init__(self, step: Step, starts: list[int], plan: HeadRows, logits, hidden, drawn: Draw,
                 rows: dict[int, int] | None) -> None:
        self.step, self.starts, self.plan = step, starts, plan
        self.logits, self.hidden, self.drawn = logits, hidden, drawn
        self.device_rows = rows

    def _read(self) -> StepOutput:
        ids, logprobs = self.drawn.lists()
        return self.plan.output(self.step, self.starts, self.logits, ids, logprobs, self.hidden)


def device_sources(step: Step, previous: PendingStep | None) -> dict[int, int] | None:
    """``{chunk index: last_ids row}`` for the chunks that follow, when every one of
    them can take its id on the device ({} when none follows); None when some
    must be resolved on the host (:func:`follow_on_host`)."""
    following = [(i, ch) for i, ch in enumerate(step.chunks) if ch.follows]
    if not following:
        return {}
    rows = getattr(previous, "device_rows", None)
    if rows is None or any(ch.seq not in rows or ch.sampling.penalized for _, ch in following):
        return None  # a penalty counts the chunk's own token on the host
    return {i: rows[ch.seq] for i, ch in following}


def follow_on_host(step: Step, previous: PendingStep | None) -> Step:
    """``step`` with the id of every following chunk filled in from ``previous``'s
    result (waits for it); ``step`` itself when no chunk follows."""
    if not any(ch.follows for ch in step.chunks):
        return step
    if previous is None:
        raise ValueError("a chunk follows the previous step's ids, but no step was launched before this one "
                         "(or it failed)")
    output = previous.result()
    chunks = []
    for ch in step.chunks:
        if ch.follows:
            ids = output.tokens.get(ch.seq)
            if not ids:
                raise ValueError(f"sequence {ch.seq} follows the previous step, which sampled nothing for it")
            ch = attrs.evolve(ch, tokens=[ids[-1]], follows=False)
        chunks.append(ch)
    return Step(chunks, step.taps, step.width, step.drafts)

"""The draft's block forward in CUDA graphs, one per (batch width, context width, drafts).

A draft forward's shapes are its batch ``B`` (decoding sequences) and the
context keys ``S`` the widest block sees (:func:`~musegl_dflash.model.context_width`).
:class:`DraftGraphs` pads ``B`` up to a power of two (at most :data:`MAX_WIDTH`)
and ``S`` up to a power of two (at least :data:`MIN_CONTEXT`, at most
:data:`MAX_CONTEXT`); each such shape has static inputs (one int64 device
buffer: per block its anchor, its start and the block ids its context keys
use, a window's worth: the host's work per step is that, not every key) and
is captured the first time a step needs it, then replayed. The graph turns
them into the context keys' slots, positions and validity on the device. Padding sequences
see no context and their drafts are ignored; padding context entries are
invalid, so a real block's attention is the unpadded one.

A forward drafts ``n`` ids a block, at most the speculator's; a step whose
sequences may verify fewer (the engine's verify-rows budget, ``max_draft`` of
each request) runs blocks of fewer mask rows: ``n`` is the largest such count
rounded up to a power of two (so at most five ``n`` per shape), and is part of
a graph's key. Every graph of ``n`` writes its draft ids into
``DraftGraphs.outs[n]`` ``(MAX_WIDTH, n)``, allocated outside the graphs'
memory pool, so the ids of a replay survive later replays of other shapes
until the next draft forward (the verify step reads them from there on the
device). Inputs are staged on the host in one
pinned buffer and sent with one copy; staging first waits for the previous
copy out of it.

On the CPU (the staging tests) nothing is captured: :meth:`DraftGraphs.run`
runs the same body eagerly over the staged buffers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import attrs
import numpy as np
import torch

from musegl_dflash.model import DFlashDraft, DraftBatch, context_reach, context_width

log = logging.getLogger("musegl.dflash")

MAX_WIDTH = 256
MIN_CONTEXT = 64
MAX_CONTEXT = 8192


def next_power(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def block_drafts(draft: DFlashDraft, rows: Callable, logits: Callable, kv: torch.Tensor, batch: DraftBatch,
                 n: int, out: torch.Tensor | None = None, argmax: Callable | None = None) -> torch.Tensor:
    """Draft ids ``(B, n)`` of the blocks ``[anchor, MASK × n]``: the argmax of the target's
    raw head (``logits``) over the final-normed mask rows, embedded with the target's raw
    rows (``rows``). ``out`` (given: ``(B, n)`` int64) receives them. ``argmax`` (given:
    ``(rows, hidden)`` to the head's argmax ids ``(rows,)``) replaces the logits and their
    argmax (a vocabulary-parallel head: no logits gathered)."""
    c = draft.config
    b = batch.anchors.shape[0]
    masks = torch.full((b, n), c.mask_token_id, dtype=torch.long, device=batch.anchors.device)
    ids = torch.cat([batch.anchors[:, None], masks], dim=1)
    hidden = draft.hidden(rows(ids).to(draft.dtype), batch, kv)[:, 1:]  # the mask rows
    if argmax is not None:
        found = argmax(hidden.reshape(-1, c.hidden_size)).view(b, n)
        return found if out is None else out.copy_(found)
    scores = logits(hidden.reshape(-1, c.hidden_size)).float()
    if out is None:
        return scores.argmax(dim=-1).view(b, n)
    torch.argmax(scores, dim=-1, out=out.view(-1))
    return out


@attrs.frozen
class BlockInputs:
    """The inputs of ``width`` blocks seeing at most ``context`` keys, as one int64 buffer:
    anchors | starts | per block the ids of the KV blocks its context keys use, from
    the block of its first key (``columns`` of them). Key ``j`` of block ``b`` is
    position ``lo_b + j`` (``lo_b = max(0, P_b − reach)``), valid below ``P_b − lo_b``:
    :func:`~musegl_dflash.model.gather_context`'s layout, computed on the device by
    :meth:`batch` from a window's worth of block ids instead of every key on the host."""

    width: int
    context: int
    block_size: int
    reach: int | None

    @property
    def columns(self) -> int:
        return self.context // self.block_size + 2  # ``context`` positions from any offset

    @property
    def words(self) -> int:
        return self.width * (2 + self.columns)

    def write(self, host: np.ndarray, anchors: Sequence[int], starts: Sequence[int],
              tables: Sequence[Sequence[int]]) -> None:
        """Fill ``host`` (``words`` int64) for ``len(anchors)`` blocks, the rest padding."""
        b, w, bs = len(anchors), self.width, self.block_size
        host[:2 * w] = 0
        host[:b] = anchors
        host[w:w + b] = starts
        table = host[2 * w:self.words].reshape(w, self.columns)
        table[:] = 0
        for i, (p, blocks) in enumerate(zip(starts, tables)):
            if p > 0:
                used = blocks[(0 if self.reach is None else max(0, p - self.reach)) // bs:(p - 1) // bs + 1]
                table[i, :len(used)] = used

    def batch(self, buffer: torch.Tensor) -> DraftBatch:
        """The :class:`DraftBatch` of a written buffer, on the buffer's device."""
        w, bs, cols = self.width, self.block_size, self.columns
        anchors, starts = buffer[:w], buffer[w:2 * w]
        table = buffer[2 * w:].view(w, cols)
        lo = torch.zeros_like(starts) if self.reach is None else (starts - self.reach).clamp(min=0)
        j = torch.arange(self.context, device=buffer.device)
        positions = lo[:, None] + j[None, :]
        valid = j[None, :] < (starts - lo)[:, None]
        column = (positions // bs - (lo // bs)[:, None]).clamp(0, cols - 1)
        slots = table.gather(1, column) * bs + positions % bs
        zero = torch.zeros_like(positions)
        return DraftBatch(anchors, starts, torch.where(valid, slots, zero), torch.where(valid, positions, zero), valid)

    @classmethod
    def exact(cls, config, block_size: int, anchors: Sequence[int], starts: Sequence[int],
              tables: Sequence[Sequence[int]], device: torch.device) -> DraftBatch:
        """The unpadded batch of these blocks on ``device`` (the forward without graphs)."""
        layout = cls(len(anchors), context_width(config, starts), block_size, context_reach(config))
        host = np.zeros(layout.words, dtype=np.int64)
        layout.write(host, anchors, starts, tables)
        return layout.batch(torch.from_numpy(host).to(device))


class DraftGraphs:
    """The draft forward's graphs of one speculator (see the module docstring)."""

    def __init__(self, draft: DFlashDraft, rows: Callable, logits: Callable, n: int, block_size: int,
                 argmax: Callable | None = None) -> None:
        self.draft = draft
        self.rows, self.logits, self.argmax = rows, logits, argmax
        self.n = n
        self.block_size = block_size
        self.device = device = draft.device
        self.capturing = device.type == "cuda"
        #: per drafts count: the ids every graph of that count writes (see the module docstring)
        self.outs: dict[int, torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._host: torch.Tensor | None = None  # pinned staging buffer, grown to the largest shape
        self._staged: torch.cuda.Event | None = None

    def shape(self, batch: int, context: int) -> tuple[int, int] | None:
        """The padded ``(width, context)`` a forward of ``batch`` blocks seeing at most
        ``context`` keys runs at; None when it is past the graphs' limits."""
        if batch > MAX_WIDTH or context > MAX_CONTEXT:
            return None
        return next_power(batch), next_power(context, MIN_CONTEXT)

    def stage(self, key: tuple[int, int], anchors: Sequence[int], starts: Sequence[int],
              tables: Sequence[Sequence[int]]) -> None:
        """Write the inputs of ``len(anchors)`` blocks into ``key``'s static buffer, the
        rest padding: per block its anchor, its start and the block ids its context
        keys use (a window's worth, not the whole table)."""
        layout = self.layout(key)
        words = layout.words
        if key not in self.inputs:
            self.inputs[key] = torch.zeros(words, dtype=torch.long, device=self.device)
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the pinned buffer is done
            self._staged = None
        if self._host is None or self._host.numel() < words:
            self._host = torch.zeros(words, dtype=torch.long, pin_memory=self.capturing)
        layout.write(self._host[:words].numpy(), anchors, starts, tables)
        self.inputs[key].copy_(self._host[:words], non_blocking=True)
        if self.capturing:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def layout(self, key: tuple[int, int]) -> "BlockInputs":
        return BlockInputs(key[0], key[1], self.block_size, context_reach(self.draft.config))

    def out(self, n: int) -> torch.Tensor:
        """The ``(MAX_WIDTH, n)`` ids the forwards of ``n`` drafts a block write."""
        if n not in self.outs:
            self.outs[n] = torch.zeros(MAX_WIDTH, n, dtype=torch.long, device=self.device)
        return self.outs[n]

    def _body(self, key: tuple[int, int, int], kv: torch.Tensor) -> None:
        shape = key[:2]
        block_drafts(self.draft, self.rows, self.logits, kv, self.layout(shape).batch(self.inputs[shape]), key[2],
                     self.out(key[2])[:key[0]], self.argmax)

    def _capture(self, key: tuple[int, int, int], kv: torch.Tensor) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the kernels, settle the allocator
                self._body(key, kv)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._body(key, kv)
        self._pool = graph.pool()
        self.graphs[key] = graph
        log.info("captured the draft graph of %d blocks x %d context keys x %d drafts in %.2f s", *key,
                 time.perf_counter() - start)

    def run(self, anchors: Sequence[int], starts: Sequence[int], tables: Sequence[Sequence[int]],
            kv: torch.Tensor, n: int | None = None) -> torch.Tensor | None:
        """The drafts ``(len(anchors), n)`` (default: the speculator's ``n``; a view of
        :meth:`out`), queued on the device; None (nothing run) when the shape is past the
        graphs' limits."""
        n = self.n if n is None else n
        if not 1 <= n <= self.n:
            raise ValueError(f"{n} drafts a block; this speculator drafts 1 .. {self.n}")
        shape = self.shape(len(anchors), context_width(self.draft.config, starts))
        if shape is None:
            return None
        key = (*shape, n)
        out = self.out(n)  # (before any capture: outside the graphs' pool)
        self.stage(shape, anchors, starts, tables)
        if not self.capturing:
            self._body(key, kv)
        else:
            if key not in self.graphs:
                self._capture(key, kv)
            self.graphs[key].replay()
        return out[:len(anchors)]


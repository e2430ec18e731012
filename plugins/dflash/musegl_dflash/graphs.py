"""The draft's block forward in CUDA graphs, one per (batch width, context width).

A draft forward's shapes are its batch ``B`` (decoding sequences) and the
context keys ``S`` the widest block sees (:func:`~musegl_dflash.model.context_width`).
:class:`DraftGraphs` pads ``B`` up to a power of two (at most :data:`MAX_WIDTH`)
and ``S`` up to a power of two (at least :data:`MIN_CONTEXT`, at most
:data:`MAX_CONTEXT`); each such shape has static inputs (one int64 device
buffer: anchors | starts | context slots | positions | validity) and is
captured the first time a step needs it, then replayed. Padding sequences
see no context and their drafts are ignored; padding context entries are
invalid, so a real block's attention is the unpadded one.

Every graph writes its draft ids into :attr:`DraftGraphs.out` ``(MAX_WIDTH, n)``,
allocated outside the graphs' memory pool, so the ids of a replay survive
later replays of other shapes until the next draft forward (the verify step
reads them from there on the device). Inputs are staged on the host in one
pinned buffer and sent with one copy; staging first waits for the previous
copy out of it.

On the CPU (the staging tests) nothing is captured: :meth:`DraftGraphs.run`
runs the same body eagerly over the staged buffers.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

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
                 n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Draft ids ``(B, n)`` of the blocks ``[anchor, MASK × n]``: the argmax of the target's
    raw head (``logits``) over the final-normed mask rows, embedded with the target's raw
    rows (``rows``). ``out`` (given: ``(B, n)`` int64) receives them."""
    c = draft.config
    b = batch.anchors.shape[0]
    masks = torch.full((b, n), c.mask_token_id, dtype=torch.long, device=batch.anchors.device)
    ids = torch.cat([batch.anchors[:, None], masks], dim=1)
    hidden = draft.hidden(rows(ids).to(draft.dtype), batch, kv)[:, 1:]  # the mask rows
    scores = logits(hidden.reshape(-1, c.hidden_size)).float()
    if out is None:
        return scores.argmax(dim=-1).view(b, n)
    torch.argmax(scores, dim=-1, out=out.view(-1))
    return out


class DraftGraphs:
    """The draft forward's graphs of one speculator (see the module docstring)."""

    def __init__(self, draft: DFlashDraft, rows: Callable, logits: Callable, n: int, block_size: int) -> None:
        self.draft = draft
        self.rows, self.logits = rows, logits
        self.n = n
        self.block_size = block_size
        self.device = device = draft.device
        self.capturing = device.type == "cuda"
        self.out = torch.zeros(MAX_WIDTH, n, dtype=torch.long, device=device)
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._host: torch.Tensor | None = None  # pinned staging buffer, grown to the largest shape
        self._staged: torch.cuda.Event | None = None

    def shape(self, batch: int, context: int) -> tuple[int, int] | None:
        """The padded ``(width, context)`` a forward of ``batch`` blocks seeing at most
        ``context`` keys runs at; None when it is past the graphs' limits."""
        if batch > MAX_WIDTH or context > MAX_CONTEXT:
            return None
        return next_power(batch), next_power(context, MIN_CONTEXT)

    @staticmethod
    def _split(buffer: torch.Tensor, width: int, context: int) -> DraftBatch:
        w, ws = width, width * context
        return DraftBatch(buffer[:w], buffer[w:2 * w], buffer[2 * w:2 * w + ws].view(width, context),
                          buffer[2 * w + ws:2 * w + 2 * ws].view(width, context),
                          buffer[2 * w + 2 * ws:].view(width, context) != 0)

    def stage(self, key: tuple[int, int], anchors: Sequence[int], starts: Sequence[int],
              tables: Sequence[Sequence[int]]) -> None:
        """Write the inputs of ``len(anchors)`` blocks into ``key``'s static buffer (padding
        the rest): the context keys of :func:`~musegl_dflash.model.gather_context`."""
        width, context = key
        words = 2 * width + 3 * width * context
        if key not in self.inputs:
            self.inputs[key] = torch.zeros(words, dtype=torch.long, device=self.device)
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the pinned buffer is done
            self._staged = None
        if self._host is None or self._host.numel() < words:
            self._host = torch.zeros(words, dtype=torch.long, pin_memory=self.capturing)
        host = self._host[:words].numpy()
        b, w, ws = len(anchors), width, width * context
        host[:w] = 0
        host[:b] = anchors
        host[w:2 * w] = 0
        host[w:w + b] = starts
        slots, positions, valid = (host[2 * w + i * ws:2 * w + (i + 1) * ws].reshape(width, context) for i in range(3))
        reach, bs = context_reach(self.draft.config), self.block_size
        for i, (p, table) in enumerate(zip(starts, tables)):
            lo = 0 if reach is None else max(0, p - reach)
            n = p - lo
            if n:
                span = np.arange(lo, p)
                blocks = np.asarray(table[lo // bs:(p - 1) // bs + 1], dtype=np.int64)
                slots[i, :n] = blocks[span // bs - lo // bs] * bs + span % bs
                positions[i, :n] = span
                valid[i, :n] = 1
            slots[i, n:] = 0
            positions[i, n:] = 0
            valid[i, n:] = 0
        for part in (slots, positions, valid):
            part[b:] = 0
        self.inputs[key].copy_(self._host[:words], non_blocking=True)
        if self.capturing:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _body(self, key: tuple[int, int], kv: torch.Tensor) -> None:
        width, context = key
        block_drafts(self.draft, self.rows, self.logits, kv, self._split(self.inputs[key], width, context), self.n,
                     self.out[:width])

    def _capture(self, key: tuple[int, int], kv: torch.Tensor) -> None:
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
        log.info("captured the draft graph of %d blocks x %d context keys in %.2f s", key[0], key[1],
                 time.perf_counter() - start)

    def run(self, anchors: Sequence[int], starts: Sequence[int], tables: Sequence[Sequence[int]],
            kv: torch.Tensor) -> torch.Tensor | None:
        """The drafts ``(len(anchors), n)`` (a view of :attr:`out`), queued on the device;
        None (nothing run) when the shape is past the graphs' limits."""
        key = self.shape(len(anchors), context_width(self.draft.config, starts))
        if key is None:
            return None
        self.stage(key, anchors, starts, tables)
        if not self.capturing:
            self._body(key, kv)
        else:
            if key not in self.graphs:
                self._capture(key, kv)
            self.graphs[key].replay()
        return self.out[:len(anchors)]


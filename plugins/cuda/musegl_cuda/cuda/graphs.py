"""Captured CUDA graphs of decode steps, one per width in ``step_sizes``.

Every graph reads the same static device buffers (tokens, positions, cache
slots, attention tiles: four views of one device buffer; block tables), sized
for the widest graph. A graph runs the whole decoder and the head over every
row, leaves float32 logits ``(width, vocab)`` in a static output and their
argmax ``(width,)`` beside them; graphs share one memory pool and are
captured widest first. Graphs built with ``taps`` (a speculator asked for
them, :meth:`~musegl_cuda.executor.TorchExecutor.expect_taps`) also leave
the tapped layers' input rows in a static ``hidden[width]`` of shape
``(len(taps), width, hidden)``, so tapped decode and verify steps replay
their graph too.

A step of a captured width is staged on the host in one pinned buffer
(tokens, positions, slots, tiles) and sent with one copy. Block tables stay
on the device between steps: a host mirror remembers which block ids each
table row holds, and only rows that changed (a new block, another sequence
in that row) are sent: a table that grew sends its new columns only. Decode
steps of one row per sequence are staged by :meth:`DecodeGraphs.stage_decode`
and other decode-only steps (draft blocks being verified) by
:meth:`DecodeGraphs.stage_rows`, neither through a
:class:`~musegl_cuda.cuda.plan.StepPlan` (:meth:`stage_plan` stages a plan).
Padding rows use the last table row (the scratch block) and write nothing
real. Steps are launched without waiting for the previous one
(:meth:`~musegl_cuda.executor.TorchExecutor.launch`), so staging first waits
for the event recorded after the previous staging copies (they run as soon as
the device reaches that step, long before the host stages again in practice).

Every graph leaves its rows' argmax in ``last_ids``; a non-greedy step's
sampler overwrites them with the drawn ids. A staged token ``-1 - r`` (a
row that *follows* the previous step) makes the graph read its token from
``last_ids[r]`` on the device, so a step can be launched before the host has
seen the previous step's ids. When every row of a step is plain greedy,
:meth:`DecodeGraphs.fetch_ids` copies back only the argmax ids (the tokens the
sampler's argmax would pick from the same logits), into one of two pinned
buffers (two steps can be in flight); other steps sample from :attr:`logits`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import numpy as np
import torch

from musegl_core.engine.step_checks import (check_block_ids, check_positions, check_tokens, coverage_error,
                                            positions_error)
from musegl_cuda.model import MuseGlimmerDecoder, PagedMeta
from musegl_cuda.cuda.plan import StepPlan

log = logging.getLogger("musegl.cuda")


class DecodeGraphs:
    """The decode graphs of one executor (see the module docstring)."""

    def __init__(self, model: MuseGlimmerDecoder, kv: torch.Tensor, sizes: tuple[int, ...], block_size: int,
                 cols: int, block_m: int, sm_count: int, taps: tuple[int, ...] = ()) -> None:
        self.model = model
        self.taps = tuple(taps)
        self.kv = kv
        self.sizes = tuple(sorted(sizes))
        self.block_size = block_size
        self.cols = cols
        self.block_m = block_m
        self.sm_count = sm_count
        device = kv.device
        self.widest = widest = self.sizes[-1]
        # one int64 buffer: tokens | positions | slots | tiles (widest x 4 int32); its pinned twin
        words = 5 * widest
        self._device_in = torch.zeros(words, dtype=torch.long, device=device)
        self.tokens = self._device_in[:widest]
        self.positions = self._device_in[widest:2 * widest]
        self.slots = self._device_in[2 * widest:3 * widest]
        self.tiles = self._device_in[3 * widest:].view(torch.int32).view(widest, 4)
        self._pinned = pinned = device.type == "cuda"  # a CPU-built instance (the staging tests) pins nothing
        self._host_in = torch.zeros(words, dtype=torch.long, pin_memory=pinned)
        host = self._host_in.numpy()
        self._h_tokens = host[:widest]
        self._h_positions = host[widest:2 * widest]
        self._h_slots = host[2 * widest:3 * widest]
        self._h_tiles = host[3 * widest:].view(np.int32).reshape(widest, 4)
        self._arange = np.arange(widest, dtype=np.int32)
        # block tables: row widest is the padding rows' table (the scratch block)
        self.tables = torch.zeros(widest + 1, cols, dtype=torch.int32, device=device)
        self._host_tables = torch.zeros((widest + 1) * cols, dtype=torch.int32, pin_memory=pinned)
        self._host_tables_np = self._host_tables.numpy()
        self._mirror = np.zeros((widest + 1, cols), dtype=np.int32)  # what the device rows hold (numpy)
        self.table_box: tuple[int, int, int, int] | None = None  # rows and columns the last staging sent
        # the host mirror of the tables: each row's block list, and how many of its ids the device row holds
        self._rows: list[list[int] | None] = [None] * (widest + 1)
        self._sent = [0] * (widest + 1)
        # the ids of the last graph step (or the sampler's, after it), read by rows that follow it
        self.last_ids = torch.zeros(widest, dtype=torch.long, device=device)
        self._ids_host = torch.zeros(2, widest, dtype=torch.long, pin_memory=pinned)  # alternating
        self._ids_turn = 0
        self._staged: torch.cuda.Event | None = None  # recorded after the last staging copies
        # (rows, width) of the last stage_decode: its padding rows and tile columns 0 are still staged
        self._layout: tuple[int, int] | None = None
        self.scratch_block = -1
        self.pool = None  # the graphs' memory pool, after capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.ids: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # (len(taps), width, hidden) per width, with taps

    def _run(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        from musegl_cuda.cuda.kernels import layer_splits  # Triton: only where graphs run

        config = self.model.config
        sliding, full = layer_splits(width, config.num_kv_heads, self.sm_count)
        meta = PagedMeta(self.slots[:width], self.tables, self.tiles[:width], width, sliding, self.block_m,
                         self.block_size, full)
        layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(config.num_layers)]
        staged = self.tokens[:width]  # >= 0: the token; -1 - r: the id in last_ids[r]
        tokens = torch.where(staged >= 0, staged, self.last_ids[(-1 - staged).clamp_(min=0)])
        normed, hidden = self.model.forward_paged(tokens, self.positions[:width], meta, layers, self.taps)
        logits = self.model.logits(normed)
        ids = self.last_ids[:width]
        torch.argmax(logits, dim=-1, out=ids)
        return logits, ids, hidden

    def reset(self, scratch_block: int) -> None:
        """Stage every row as a padding row (writing ``scratch_block``) and forget
        the tables the device holds: what a capture starts from."""
        self.scratch_block = scratch_block
        self.slots.fill_(scratch_block * self.block_size)
        self.tables.zero_()
        self.tables[:, 0] = scratch_block
        self._rows = [None] * (self.widest + 1)
        self._sent = [0] * (self.widest + 1)
        self._mirror[:] = 0
        self._mirror[:, 0] = scratch_block
        self.tiles.zero_()
        widest = self.widest
        self.tiles[:, 0] = widest  # the padding table row
        self.tiles[:, 1] = torch.arange(widest, dtype=torch.int32, device=self.tiles.device)
        self.tiles[:, 2] = 1
        # the pinned twin of the tiles: columns 1 and 2 never change
        self._h_tiles[:, 0] = widest
        self._h_tiles[:, 1] = self._arange
        self._h_tiles[:, 2] = 1
        self._h_tiles[:, 3] = 0
        self._layout = None

    def capture(self, scratch_block: int, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Capture every width (rows all padding, writing ``scratch_block``); returns seconds."""
        start = time.perf_counter()
        self.reset(scratch_block)
        pool = None
        with torch.inference_mode():
            for done, width in enumerate(reversed(self.sizes)):
                if progress is not None:
                    progress(done, len(self.sizes), f"decode graph width {width}")
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compile the kernels, settle the allocator
                        self._run(width)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[width], self.ids[width], hidden = self._run(width)
                if hidden is not None:
                    self.hidden[width] = hidden
                pool = graph.pool()
                self.graphs[width] = graph
            self.pool = pool  # the sampler graphs share it
            torch.cuda.synchronize()
        if progress is not None:
            progress(len(self.sizes), len(self.sizes), "decode graphs captured")
        elapsed = time.perf_counter() - start
        log.info("captured %d decode graphs (widths %s) in %.1f s", len(self.sizes),
                 ",".join(map(str, self.sizes)), elapsed)
        return elapsed

    def fits(self, plan: StepPlan) -> bool:
        return plan.width in self.graphs and plan.tables.shape[1] <= self.cols

    def serves_taps(self, taps: tuple[int, ...]) -> bool:
        """A step asking for ``taps`` can replay a graph: none asked, or the graphs' own."""
        return not taps or tuple(taps) == self.taps

    def tapped_rows(self, width: int, rows: int) -> torch.Tensor:
        """A copy of the first ``rows`` tapped rows of the last replay of ``width``,
        ``(len(taps), rows, hidden)``: the next replay overwrites the static buffer."""
        return self.hidden[width][:, :rows].clone()

    # -- staging -------------------------------------------------------------------

    def _send_tables(self, changed: list[int], c0: int, c1: int) -> None:
        """Copy the box of the numpy mirror rows ``min(changed) .. max(changed)``,
        columns ``c0 .. c1``, to the device in one copy (a row in the box that did not
        change sends what the device already holds, or columns past what it uses)."""
        r0, r1 = min(changed), max(changed) + 1
        h, w = r1 - r0, c1 - c0
        compact = self._host_tables_np[:h * w].reshape(h, w)
        compact[:] = self._mirror[r0:r1, c0:c1]
        self.tables[r0:r1, c0:c1].copy_(self._host_tables[:h * w].view(h, w), non_blocking=True)
        self.table_box = (r0, r1, c0, c1)

    def _check_tables(self, chunks: Sequence, lasts: Sequence[int], num_blocks: int) -> tuple[list, list]:
        """Each chunk's table against what device row ``i`` holds, raising (nothing
        changed) for a table that does not cover position ``lasts[i]`` or names a block
        outside the pool: ``(changed, lists)``, the rows to send as (row, its blocks,
        the first column to send, the columns needed) and every chunk's blocks as a list."""
        bs = self.block_size
        rows, sent = self._rows, self._sent
        changed: list[tuple[int, list[int], int, int]] = []
        lists: list[list[int]] = []
        for i, c in enumerate(chunks):
            last = lasts[i]
            need = last // bs + 1
            blocks = c.blocks
            if type(blocks) is not list:
                blocks = list(blocks)
            old = rows[i]
            if need > sent[i] or blocks != old:  # the device row lacks blocks, or holds others
                if need > len(blocks):
                    raise coverage_error(c.seq, last, bs, len(blocks))
                # the device keeps its first sent[i] ids when they are still the row's (a table grew):
                # only the new columns are checked and sent, not the whole table
                was = sent[i]
                first = was if old is not None and was and blocks[:was] == old[:was] else 0
                check_block_ids(blocks[first:need], num_blocks, c.seq)
                changed.append((i, blocks, first, need))
            lists.append(blocks)
        return changed, lists

    def _apply_tables(self, chunks: Sequence, changed: list) -> None:
        """Update the mirror with :meth:`_check_tables`' changes and send them (one box)."""
        self.table_box = None
        if not changed:
            return
        mirror, rows, sent = self._mirror, self._rows, self._sent
        c0, c1 = self.cols, 1
        for i, blocks, first, need in changed:
            mirror[i, first:need] = blocks[first:need]
            rows[i] = list(blocks) if blocks is chunks[i].blocks else blocks  # a copy: lists grow in place
            sent[i] = need
            c0, c1 = min(c0, first), max(c1, need)
        self._send_tables([i for i, _, _, _ in changed], min(c0, c1 - 1), c1)

    def _wait_staged(self) -> None:
        """Before the pinned staging buffers are rewritten: the copies out of them done."""
        if self._staged is not None:
            self._staged.synchronize()
            self._staged = None

    def _record_staged(self) -> None:
        if self._pinned:
            self._staged = torch.cuda.Event()
            self._staged.record()

    def stage_decode(self, chunks: Sequence, width: int, num_blocks: int, vocab: int,
                     sources: dict[int, int] | None = None) -> bool:
        """Check and stage a decode step of one row per chunk, padded to ``width``
        (a captured width): the inputs of :meth:`replay`. ``sources`` maps the
        index of a chunk that follows the previous step to the ``last_ids`` row
        its token is read from (its ``tokens[0]`` is a placeholder). False
        (nothing sent) when a block table is wider than the graphs' tables;
        raises ``ValueError`` (nothing sent) for a step that cannot run."""
        n = len(chunks)
        bs = self.block_size
        tokens = [c.tokens[0] for c in chunks]
        positions = [c.positions[0] for c in chunks]
        if max(positions) // bs >= self.cols:
            return False
        if min(positions) < 0:
            raise positions_error(next(c for c in chunks if c.positions[0] < 0).seq)
        sources = sources or {}
        for i, c in enumerate(chunks):
            if c.follows and i not in sources:
                raise ValueError(f"sequence {c.seq} follows the previous step but was given no source row")
        if sources:
            for i, row in sources.items():
                if not 0 <= row < self.widest:
                    raise ValueError(f"sequence {chunks[i].seq}: it follows row {row}, outside the graphs' rows")
                tokens[i] = -1 - row
            known = [t for i, t in enumerate(tokens) if i not in sources]
        else:
            known = tokens
        check_tokens(known, vocab)
        self._wait_staged()
        changed, lists = self._check_tables(chunks, positions, num_blocks)
        self._apply_tables(chunks, changed)
        slots = [blocks[p // bs] * bs + p % bs for blocks, p in zip(lists, positions)]
        tiles = self._h_tiles
        if self._layout != (n, width):  # padding rows and tile columns 0 change only with the layout
            self._h_tokens[n:width] = 0
            self._h_positions[n:width] = 0
            self._h_slots[n:width] = self.scratch_block * bs
            tiles[:n, 0] = self._arange[:n]
            tiles[n:width, 0] = self.widest
            tiles[n:width, 3] = 0
            tiles[:width, 1] = self._arange[:width]  # a planned or multi-row step in between rewrote them
            tiles[:width, 2] = 1
            self._layout = (n, width)
        self._h_tokens[:n] = tokens
        self._h_positions[:n] = positions
        self._h_slots[:n] = slots
        tiles[:n, 3] = self._h_positions[:n]
        self._device_in.copy_(self._host_in, non_blocking=True)
        self._record_staged()
        return True

    def stage_plan(self, plan: StepPlan) -> None:
        """Stage a planned decode-only step (tiles padded to its width; table row
        ``len(chunks)`` is its padding rows' table): every table row it uses is sent."""
        width = plan.width
        self._wait_staged()
        self._h_tokens[:width] = plan.tokens
        self._h_positions[:width] = plan.positions
        self._h_slots[:width] = plan.slots
        self._h_tiles[:width] = plan.tiles
        seqs, cols = plan.tables.shape
        compact = self._host_tables_np[:seqs * cols].reshape(seqs, cols)
        compact[:] = plan.tables
        self.tables[:seqs, :cols].copy_(self._host_tables[:seqs * cols].view(seqs, cols), non_blocking=True)
        for i in range(seqs):
            self._rows[i], self._sent[i] = None, 0  # holds the plan's row now, not a mirrored table
        self._device_in.copy_(self._host_in, non_blocking=True)
        self._layout = None  # the next stage_decode rewrites its layout (after this copy is done)
        self._record_staged()

    def stage_rows(self, chunks: Sequence, width: int, num_blocks: int, vocab: int,
                   tile_rows: int) -> list[int] | None:
        """Check and stage a decode-only step whose chunks may hold several rows (draft
        blocks being verified), padded to ``width``, without a plan: the tiles are
        :func:`~musegl_cuda.cuda.plan.plan_step`'s (up to ``tile_rows`` rows of one chunk,
        then one per padding row, then empty ones up to ``width``), the tables go
        through the mirror as :meth:`stage_decode`'s do (new columns only). Returns
        each chunk's first row; None (nothing sent) when a table is wider than the
        graphs' tables; raises ``ValueError`` (nothing sent) for a step that cannot run."""
        bs = self.block_size
        n = sum(len(c.tokens) for c in chunks)
        if n > width:
            raise ValueError(f"width {width} is below the step's {n} rows")
        lasts = []
        for c in chunks:
            check_positions(c)
            lasts.append(c.positions[0] + len(c.tokens) - 1)
        if max(lasts) // bs >= self.cols:
            return None
        tokens = [t for c in chunks for t in c.tokens]
        check_tokens(tokens, vocab)
        self._wait_staged()
        changed, lists = self._check_tables(chunks, lasts, num_blocks)
        self._apply_tables(chunks, changed)
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        tiles: list[tuple[int, int, int, int]] = []
        for i, c in enumerate(chunks):
            blocks, first, k, row = lists[i], c.positions[0], len(c.tokens), len(positions)
            starts.append(row)
            for p in range(first, first + k):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            tiles.extend((i, row + off, min(tile_rows, k - off), first + off) for off in range(0, k, tile_rows))
        tiles.extend((self.widest, r, 1, 0) for r in range(n, width))  # the padding rows' table row
        if len(tiles) > width:
            raise ValueError(f"{len(tiles)} tiles exceed the {width} a graph launches")
        tiles.extend((0, 0, 0, 0) for _ in range(width - len(tiles)))
        self._h_tokens[:n] = tokens
        self._h_positions[:n] = positions
        self._h_slots[:n] = slots
        self._h_tokens[n:width] = 0
        self._h_positions[n:width] = 0
        self._h_slots[n:width] = self.scratch_block * bs
        self._h_tiles[:width] = tiles
        self._device_in.copy_(self._host_in, non_blocking=True)
        self._layout = None
        self._record_staged()
        return starts

    def replay(self, width: int) -> None:
        """Replay the graph of ``width`` over what was staged last."""
        self.graphs[width].replay()

    def fetch_ids(self, width: int, rows: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Queue the copy of the first ``rows`` argmax ids of the last replay into the
        next of the two pinned buffers: (that buffer, an event recorded after the
        copy). The caller reads the buffer after the event and before a second
        later fetch reuses it."""
        host = self._ids_host[self._ids_turn]
        self._ids_turn ^= 1
        host[:rows].copy_(self.ids[width][:rows], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def greedy_ids(self, width: int, rows: int) -> list[int]:
        """The argmax ids of the first ``rows`` rows of the last replay (waits for them)."""
        host, event = self.fetch_ids(width, rows)
        event.synchronize()
        return host[:rows].tolist()

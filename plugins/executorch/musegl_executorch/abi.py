"""The host side of the off-graph ABI: a step of the engine becomes program calls.

A :class:`~musegl_core.engine.executor.Step` is split into calls of the
exported methods (see :mod:`musegl_executorch.export.graph` for the inputs):

* single-row chunks (decode rows) go together through ``forward_{N}``, the
  smallest exported width that holds them (the widest, repeatedly, when
  they are more); unused groups are padding that reads nothing and whose
  rows are never written;
* every chunk of several rows (a prefill chunk, drafts being verified) goes
  alone through ``forward_others``, in pieces of at most the exported
  ``max_prefill_chunk`` rows; a later piece reads the earlier pieces' keys
  from the pool, so the caller writes each call's rows before the next.

Pool cells are ``block · block_size + offset`` (the engine's block ids).

**Sliding pages** (a program exported with ``--sliding-pages``): every group of
layers has its own cells, ``page · block_size + offset`` in its own table (the
full layers' ``blocks``, each sliding group's ``sliding_blocks``), so a call
carries one set of window cells per sliding group and the caller writes each
group's rows at its own cells (:attr:`Call.sliding_writes`); a ``keep_full``
chunk (a rewind past the window) writes no full layer's row. Served without
``--sliding-window-kv``, such a program keeps every position: sliding group
``g``'s page of block ``b`` is the fixed page ``b + g · blocks``
(``fixed_pages``).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import SeqChunk
from musegl_core.engine.step_checks import check_positions, check_tokens, table_of

NEG_INF = np.float32(-np.inf)


@attrs.define
class Piece:
    """Rows ``lo .. hi-1`` of one chunk, run as one group."""

    chunk: int  # index of the chunk in the step
    lo: int
    hi: int


@attrs.define
class Call:
    """One program call: the method, its inputs (numpy), and where each row goes."""

    method: str
    inputs: dict[str, np.ndarray]
    pieces: list[Piece]
    write_slots: np.ndarray  # (rows,) pool cell of every real row, -1 for padding rows
    head_of: dict[tuple[int, int], int]  # (chunk, chunk row) -> index into this call's logits
    #: sliding pages: (sliding groups, rows) the cells of each sliding group's rows (write_slots: the full
    #: layers'; -1 where a row is not written), else None
    sliding_writes: np.ndarray | None = None


@attrs.frozen
class Pages:
    """How a program exported with sliding pages finds each group's cells."""

    sliding_groups: int
    #: the pool's pages per group when every position is kept (sliding group g's page of block b is
    #: ``b + g · fixed``), None with the engine's sliding pages (``SeqChunk.sliding_blocks``)
    fixed: int | None = None

    def tables(self, chunk: SeqChunk) -> list[list[int]]:
        """Each sliding group's block table of the chunk (-1 where no row's window reaches it)."""
        if self.fixed is not None:
            return [[b + g * self.fixed for b in chunk.blocks] for g in range(1, 1 + self.sliding_groups)]
        if len(chunk.sliding_blocks) != self.sliding_groups:
            raise ValueError(f"sequence {chunk.seq}: {len(chunk.sliding_blocks)} sliding block tables for "
                             f"{self.sliding_groups} groups of sliding layers")
        return [list(table) for table in chunk.sliding_blocks]


def cells(chunk: SeqChunk, block_size: int, num_blocks: int, upto: int) -> np.ndarray:
    """Pool cells of positions ``0 .. upto-1`` of the chunk's sequence (``upto >= 1``)."""
    table = np.asarray(table_of(chunk, block_size, num_blocks, last=upto - 1), dtype=np.int64)
    pos = np.arange(upto, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def pad_keys(slot_rows: list[np.ndarray], bias_rows: list[np.ndarray], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Stack per-group key slots and biases, padded to the longest (at least one key,
    hidden everywhere: a group with no cached keys still has a well-formed input)."""
    width = max(1, max(len(s) for s in slot_rows))
    slots = np.zeros((len(slot_rows), width), dtype=np.int64)
    bias = np.full((len(slot_rows), rows, width), NEG_INF, dtype=np.float32)
    for g, (s, b) in enumerate(zip(slot_rows, bias_rows)):
        slots[g, :len(s)] = s
        bias[g, :, :b.shape[1]] = b
    return slots, bias


def group_keys(chunk: SeqChunk, lo: int, hi: int, all_cells: np.ndarray, window: int):
    """The cached keys a piece reads: (full slots, full bias, window slots, window bias)."""
    first = chunk.positions[lo]
    query = np.asarray(chunk.positions[lo:hi], dtype=np.int64)
    full_slots = all_cells[:first]
    full_bias = np.zeros((hi - lo, first), dtype=np.float32)
    start = max(0, first - window + 1)  # the oldest key any row of a sliding layer can see
    key_pos = np.arange(start, first, dtype=np.int64)
    visible = (query[:, None] - key_pos[None, :]) < window
    window_bias = np.where(visible, np.float32(0), NEG_INF).astype(np.float32)
    return full_slots, full_bias, all_cells[start:first], window_bias


def plan_calls(chunks: Sequence[SeqChunk], head_rows: Sequence[Sequence[int]], *, block_size: int,
               num_blocks: int, window: int, vocab: int, sizes: Sequence[int], max_chunk: int,
               embedded: frozenset[int] = frozenset(), min_head_rows: int = 1, pages: Pages | None = None) -> list[Call]:
    """The program calls that run ``chunks``; ``head_rows[i]`` lists the rows of chunk
    ``i`` whose logits are needed (sampled rows, logit rows). The chunks listed in
    ``embedded`` (those with image rows) run alone through ``forward_from_embeddings``
    in pieces of at most ``max_chunk`` rows, one-row chunks included; the caller gives
    their input rows. ``min_head_rows`` is the export's (the manifest's
    ``limits.min_head_rows``): with 0, a ``forward_others``/``forward_from_embeddings``
    piece that needs no logits passes no head row and skips the head; ``forward_{N}``
    always runs it on at least one row. ``pages``: a program exported with sliding pages
    (``num_blocks`` then counts every page of the pool)."""
    for chunk in chunks:
        check_positions(chunk)
        check_tokens(chunk.tokens, vocab)
    calls: list[Call] = []
    singles = [i for i, c in enumerate(chunks) if len(c.tokens) == 1 and i not in embedded]
    if sizes:
        widest = max(sizes)
        while singles:
            take = singles[:widest]
            singles = singles[widest:]
            width = min(s for s in sizes if s >= len(take))
            calls.append(_call(f"forward_{width}", [Piece(i, 0, 1) for i in take], width, 1, chunks, head_rows,
                               block_size, num_blocks, window, 1, pages))
    for i, chunk in enumerate(chunks):
        if len(chunk.tokens) == 1 and sizes and i not in embedded:
            continue
        method = "forward_from_embeddings" if i in embedded else "forward_others"
        for lo in range(0, len(chunk.tokens), max_chunk):
            hi = min(lo + max_chunk, len(chunk.tokens))
            calls.append(_call(method, [Piece(i, lo, hi)], 1, hi - lo, chunks, head_rows,
                               block_size, num_blocks, window, min_head_rows, pages))
    return calls


def _call(method: str, pieces: list[Piece], groups: int, rows: int, chunks: Sequence[SeqChunk],
          head_rows: Sequence[Sequence[int]], block_size: int, num_blocks: int, window: int,
          min_head_rows: int, pages: Pages | None = None) -> Call:
    tokens = np.zeros((groups, rows), dtype=np.int64)
    positions = np.zeros((groups, rows), dtype=np.int64)
    write = np.full(groups * rows, -1, dtype=np.int64)
    full_slots, full_bias, window_slots, window_bias = [], [], [], []
    sliding = pages.sliding_groups if pages is not None else 0
    group_window = [[] for _ in range(sliding)]  # sliding pages: each group's window cells, per piece
    group_write = np.full((sliding, groups * rows), -1, dtype=np.int64)
    heads: list[int] = []
    head_of: dict[tuple[int, int], int] = {}
    for g, piece in enumerate(pieces):
        chunk = chunks[piece.chunk]
        n = piece.hi - piece.lo
        tokens[g, :n] = chunk.tokens[piece.lo:piece.hi]
        positions[g, :n] = chunk.positions[piece.lo:piece.hi]
        all_cells = cells(chunk, block_size, num_blocks, chunk.positions[piece.hi - 1] + 1)
        write[g * rows:g * rows + n] = all_cells[chunk.positions[piece.lo]:]
        fs, fb, ws, wb = group_keys(chunk, piece.lo, piece.hi, all_cells, window)
        full_slots.append(fs), full_bias.append(fb), window_slots.append(ws), window_bias.append(wb)
        if pages is not None:
            first, upto = chunk.positions[piece.lo], chunk.positions[piece.hi - 1] + 1
            start = first - len(ws)  # the window's first position
            if chunk.keep_full:  # a rewind past the window: the full layers' K/V stay as they are
                write[g * rows:g * rows + n] = -1
            for s, table in enumerate(pages.tables(chunk)):
                mine = group_cells(table, block_size, num_blocks, start, upto, chunk.seq)
                group_window[s].append(mine[:first - start])
                group_write[s, g * rows:g * rows + n] = mine[first - start:]
        for r in head_rows[piece.chunk]:
            if piece.lo <= r < piece.hi:
                head_of[(piece.chunk, r)] = len(heads)
                heads.append(g * rows + r - piece.lo)
    for _ in range(len(pieces), groups):  # padding groups: no keys but their own row
        full_slots.append(np.zeros(0, np.int64)), full_bias.append(np.zeros((rows, 0), np.float32))
        window_slots.append(np.zeros(0, np.int64)), window_bias.append(np.zeros((rows, 0), np.float32))
        for cells_of_group in group_window:
            cells_of_group.append(np.zeros(0, np.int64))
    fs, fb = pad_keys(full_slots, full_bias, rows)
    ws, wb = pad_keys(window_slots, window_bias, rows)
    if pages is not None:  # one set of window cells per sliding group, the bias shared (same positions)
        ws = np.stack([pad_keys(cells_of_group, window_bias, rows)[0] for cells_of_group in group_window])
    if len(heads) < min_head_rows:
        heads = [0]  # the method runs the head on at least one row; nobody reads it
    # np.fromiter: an empty head_rows with stride 1 (np.asarray's has stride 0, which the runtime refuses)
    inputs = {"tokens": tokens, "positions": positions, "full_slots": fs, "full_bias": fb,
              "window_slots": ws, "window_bias": wb, "head_rows": np.fromiter(heads, dtype=np.int64, count=len(heads))}
    return Call(method, inputs, pieces, write, head_of, group_write if pages is not None else None)


def group_cells(table: Sequence[int], block_size: int, num_blocks: int, start: int, upto: int, seq) -> np.ndarray:
    """Pool cells of positions ``start .. upto-1`` in a sliding group's ``table`` (its pages,
    checked). A page that left (-1) reads page 0, as ``group_tables`` has it for the other
    executors: only the first rows of a rewind's recomputation read there, whose sliding K/V
    need not be exact (docs/engine.md "Rewinds past the window")."""
    if (upto - 1) // block_size >= len(table):
        raise ValueError(f"sequence {seq}: a sliding block table of {len(table)} pages does not cover "
                         f"position {upto - 1}")
    pos = np.arange(start, upto, dtype=np.int64)
    pages = np.maximum(np.asarray(table, dtype=np.int64)[pos // block_size], 0)
    if pos.size and pages.max() >= num_blocks:
        raise ValueError(f"sequence {seq}: a sliding page of positions {start}..{upto - 1} lies outside the "
                         f"pool of {num_blocks} pages")
    return pages * block_size + pos % block_size

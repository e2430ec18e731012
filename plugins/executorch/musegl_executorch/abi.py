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
               embedded: frozenset[int] = frozenset(), min_head_rows: int = 1) -> list[Call]:
    """The program calls that run ``chunks``; ``head_rows[i]`` lists the rows of chunk
    ``i`` whose logits are needed (sampled rows, logit rows). The chunks listed in
    ``embedded`` (those with image rows) run alone through ``forward_from_embeddings``
    in pieces of at most ``max_chunk`` rows, one-row chunks included; the caller gives
    their input rows. ``min_head_rows`` is the export's (the manifest's
    ``limits.min_head_rows``): with 0, a ``forward_others``/``forward_from_embeddings``
    piece that needs no logits passes no head row and skips the head; ``forward_{N}``
    always runs it on at least one row."""
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
                               block_size, num_blocks, window, 1))
    for i, chunk in enumerate(chunks):
        if len(chunk.tokens) == 1 and sizes and i not in embedded:
            continue
        method = "forward_from_embeddings" if i in embedded else "forward_others"
        for lo in range(0, len(chunk.tokens), max_chunk):
            hi = min(lo + max_chunk, len(chunk.tokens))
            calls.append(_call(method, [Piece(i, lo, hi)], 1, hi - lo, chunks, head_rows,
                               block_size, num_blocks, window, min_head_rows))
    return calls


def _call(method: str, pieces: list[Piece], groups: int, rows: int, chunks: Sequence[SeqChunk],
          head_rows: Sequence[Sequence[int]], block_size: int, num_blocks: int, window: int,
          min_head_rows: int) -> Call:
    tokens = np.zeros((groups, rows), dtype=np.int64)
    positions = np.zeros((groups, rows), dtype=np.int64)
    write = np.full(groups * rows, -1, dtype=np.int64)
    full_slots, full_bias, window_slots, window_bias = [], [], [], []
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
        for r in head_rows[piece.chunk]:
            if piece.lo <= r < piece.hi:
                head_of[(piece.chunk, r)] = len(heads)
                heads.append(g * rows + r - piece.lo)
    for _ in range(len(pieces), groups):  # padding groups: no keys but their own row
        full_slots.append(np.zeros(0, np.int64)), full_bias.append(np.zeros((rows, 0), np.float32))
        window_slots.append(np.zeros(0, np.int64)), window_bias.append(np.zeros((rows, 0), np.float32))
    fs, fb = pad_keys(full_slots, full_bias, rows)
    ws, wb = pad_keys(window_slots, window_bias, rows)
    if len(heads) < min_head_rows:
        heads = [0]  # the method runs the head on at least one row; nobody reads it
    # np.fromiter: an empty head_rows with stride 1 (np.asarray's has stride 0, which the runtime refuses)
    inputs = {"tokens": tokens, "positions": positions, "full_slots": fs, "full_bias": fb,
              "window_slots": ws, "window_bias": wb, "head_rows": np.fromiter(heads, dtype=np.int64, count=len(heads))}
    return Call(method, inputs, pieces, write, head_of)

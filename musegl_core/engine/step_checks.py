"""The checks every executor makes on a step before it runs it, with one set of messages.

The scheduler never builds a step that fails them; they guard an executor
against a step it cannot run (a bug, a hand-built step in a test, another
engine): positions of a chunk consecutive and >= 0, a block table that
covers every position the chunk reads or writes, block ids inside the pool,
token ids inside the vocabulary, tapped layers that exist. Each raises
``ValueError`` with the same words whichever executor finds the problem
(the engine fails that step's requests with a 500 and keeps serving).

:func:`check_step` checks a whole step; the smaller functions serve the
paths that check as they go (the CUDA graphs' staging checks only the block
tables that changed since the previous step). Pure Python and numpy: the
arguments may be lists or numpy arrays.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from musegl_core.engine.executor import SeqChunk, Step


def _bounds(values: Sequence[int]) -> tuple[int, int]:
    if isinstance(values, np.ndarray):
        return int(values.min()), int(values.max())
    return min(values), max(values)


def positions_error(seq: int) -> ValueError:
    return ValueError(f"sequence {seq}: chunk positions must be consecutive and >= 0")


def coverage_error(seq: int, position: int, block_size: int, table_length: int) -> ValueError:
    return ValueError(f"sequence {seq}: position {position} needs block {position // block_size} "
                      f"but its block table has {table_length} blocks")


def block_ids_error(num_blocks: int, seq: int | None = None) -> ValueError:
    where = "" if seq is None else f"sequence {seq}: "
    return ValueError(f"{where}block ids must lie in 0..{num_blocks - 1}")


def vocabulary_error(vocab_size: int) -> ValueError:
    return ValueError(f"token id outside the vocabulary 0..{vocab_size - 1}")


def check_positions(chunk: SeqChunk) -> None:
    """The chunk's positions are consecutive and start at 0 or later."""
    positions = chunk.positions
    first, n = int(positions[0]), len(positions)
    if first < 0:
        raise positions_error(chunk.seq)
    if n == 1:
        return
    if isinstance(positions, np.ndarray):
        ok = bool(np.array_equal(positions, np.arange(first, first + n)))
    else:
        ok = list(positions) == list(range(first, first + n))
    if not ok:
        raise positions_error(chunk.seq)


def check_block_ids(blocks: Sequence[int], num_blocks: int, seq: int | None = None) -> None:
    """Every id of ``blocks`` names a block of the pool (``0 .. num_blocks - 1``)."""
    if len(blocks):
        lo, hi = _bounds(blocks)
        if lo < 0 or hi >= num_blocks:
            raise block_ids_error(num_blocks, seq)


def check_copy_pairs(pairs: Sequence[tuple[int, int]], num_blocks: int) -> None:
    """Both blocks of every ``copy_blocks`` pair lie in the pool."""
    check_block_ids([b for pair in pairs for b in pair], num_blocks)


def table_of(chunk: SeqChunk, block_size: int, num_blocks: int, last: int | None = None) -> Sequence[int]:
    """The leading blocks of the chunk's table that hold positions ``0 .. last``
    (default: the chunk's last position), checked: the table covers ``last`` and
    every one of those ids lies in the pool."""
    if last is None:
        last = int(chunk.positions[-1])
    need = last // block_size + 1
    if need > len(chunk.blocks):
        raise coverage_error(chunk.seq, last, block_size, len(chunk.blocks))
    table = chunk.blocks[:need]
    check_block_ids(table, num_blocks, chunk.seq)
    return table


def check_tokens(tokens: Sequence[int], vocab_size: int) -> None:
    """Every id lies in the vocabulary ``0 .. vocab_size - 1``."""
    if len(tokens):
        lo, hi = _bounds(tokens)
        if lo < 0 or hi >= vocab_size:
            raise vocabulary_error(vocab_size)


def kv_allocated(storage, before: str = "the KV cache is used"):
    """``storage`` (an executor's or a speculator's KV arrays), or ``RuntimeError``
    when ``allocate_kv`` has not given it yet."""
    if storage is None:
        raise RuntimeError(f"allocate_kv() must be called before {before}")
    return storage


def check_taps(taps: Sequence[int], num_layers: int) -> None:
    """Tapped layers are ``0 .. num_layers`` (``num_layers``: the last layer's output)."""
    for t in taps:
        if not 0 <= t <= num_layers:
            raise ValueError(f"tap {t} outside 0..{num_layers}")


def check_chunk(chunk: SeqChunk, block_size: int, num_blocks: int, vocab_size: int) -> Sequence[int]:
    """Positions, block table and token ids of one chunk (a chunk that
    :attr:`~SeqChunk.follows` has a placeholder token, not checked); returns
    :func:`table_of` the chunk."""
    check_positions(chunk)
    table = table_of(chunk, block_size, num_blocks)
    if not chunk.follows:
        check_tokens(chunk.tokens, vocab_size)
    return table


def check_step(step: Step, block_size: int, num_blocks: int, vocab_size: int,
               num_layers: int | None = None) -> list[Sequence[int]]:
    """:func:`check_chunk` every chunk (and :func:`check_taps` when ``num_layers``
    is given); returns the chunks' checked tables."""
    if num_layers is not None:
        check_taps(step.taps, num_layers)
    return [check_chunk(chunk, block_size, num_blocks, vocab_size) for chunk in step.chunks]

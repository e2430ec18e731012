"""The host side of a packed step on the CUDA path: flat arrays the kernels read.

:func:`plan_step` turns a :class:`~musegl_core.engine.executor.Step` into
numpy arrays (one pass over the chunks, no per-row Python work beyond
concatenation):

* ``tokens``, ``positions``: one entry per packed row (``width`` rows; rows
  past the step's own tokens are padding);
* ``slots``: the cache slot (``block·block_size + offset``) each row writes;
  padding rows write the executor's scratch block, never a real one;
* ``tables``: one block table per chunk (plus one for the padding rows), as
  an ``int32`` matrix padded with 0 to a common width;
* ``tiles``: the work items of the attention kernel, ``(seq, first row,
  rows, first position)``: consecutive rows of one chunk, at most
  ``rows_per_tile`` of them; a tile's keys are ``0 .. last position`` of
  its table (the kernel applies causality and the window per row).

The same plan feeds the captured decode graphs (copied into their static
buffers) and the dynamic path. :func:`reference_attention` computes what
the kernel computes from a plan, in plain torch, so the plan is tested on
the CPU.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import Step
from musegl_core.engine.step_checks import check_block_ids, check_positions, check_tokens, coverage_error


@attrs.define
class StepPlan:
    """Flat per-row and per-tile arrays of one step (see the module docstring)."""

    tokens: np.ndarray  # (width,) int64
    positions: np.ndarray  # (width,) int64
    slots: np.ndarray  # (width,) int64
    tables: np.ndarray  # (chunks [+1], cols) int32
    tiles: np.ndarray  # (tiles, 4) int32: seq, first row, rows, first position
    starts: list[int]  # first packed row of each chunk
    num_tokens: int  # real rows; rows num_tokens..width-1 are padding

    @property
    def width(self) -> int:
        return len(self.tokens)


def rows_per_tile(block_m: int, group: int) -> int:
    """Query rows one attention program serves: ``block_m`` query vectors are
    ``rows × group`` (every query head of one KV head)."""
    return max(1, block_m // group)


def plan_step(step: Step, block_size: int, num_blocks: int, vocab: int, tile_rows: int,
              width: int | None = None, scratch_block: int | None = None, num_tiles: int | None = None,
              cols: int | None = None) -> StepPlan:
    """Check ``step`` and flatten it (see the module docstring).

    ``width`` (default: the step's own rows) pads with rows that write
    ``scratch_block``; ``num_tiles`` pads the tile list with empty tiles (a
    captured graph launches a fixed grid); ``cols`` fixes the table width.
    Raises ``ValueError`` for a step that cannot run.
    """
    chunks = step.chunks
    n = step.num_tokens
    width = n if width is None else width
    if width < n:
        raise ValueError(f"width {width} is below the step's {n} rows")
    if width > n and scratch_block is None:
        raise ValueError("padding rows need a scratch block")
    tokens = np.empty(width, dtype=np.int64)
    positions = np.empty(width, dtype=np.int64)
    needed = [0] * len(chunks)
    starts: list[int] = []
    row = 0
    for i, chunk in enumerate(chunks):
        k = len(chunk.tokens)
        first = chunk.positions[0]
        pos = np.asarray(chunk.positions, dtype=np.int64)
        check_positions(chunk)
        last = first + k - 1
        needed[i] = last // block_size + 1
        if needed[i] > len(chunk.blocks):
            raise coverage_error(chunk.seq, last, block_size, len(chunk.blocks))
        tokens[row:row + k] = chunk.tokens
        positions[row:row + k] = pos
        starts.append(row)
        row += k
    check_tokens(tokens[:n], vocab)

    padded = width > n
    ncols = max(needed + [1])
    if cols is not None:
        if ncols > cols:
            raise ValueError(f"a block table of {ncols} blocks exceeds the {cols} columns")
        ncols = cols
    tables = np.zeros((len(chunks) + (1 if padded else 0), ncols), dtype=np.int32)
    tile_list: list[tuple[int, int, int, int]] = []
    for i, chunk in enumerate(chunks):
        blocks = np.asarray(chunk.blocks[:needed[i]], dtype=np.int64)
        check_block_ids(blocks, num_blocks, chunk.seq)
        tables[i, :needed[i]] = blocks
        k, first = len(chunk.tokens), chunk.positions[0]
        for off in range(0, k, tile_rows):
            tile_list.append((i, starts[i] + off, min(tile_rows, k - off), first + off))
    slot_parts = []
    for i, chunk in enumerate(chunks):
        pos = positions[starts[i]:starts[i] + len(chunk.tokens)]
        slot_parts.append(tables[i, pos // block_size].astype(np.int64) * block_size + pos % block_size)
    slots = np.empty(width, dtype=np.int64)
    if slot_parts:
        slots[:n] = np.concatenate(slot_parts)
    if padded:
        pad_seq = len(chunks)
        tables[pad_seq, 0] = scratch_block
        tokens[n:] = 0
        positions[n:] = 0
        slots[n:] = int(scratch_block) * block_size
        tile_list.extend((pad_seq, r, 1, 0) for r in range(n, width))
    if num_tiles is not None:
        if len(tile_list) > num_tiles:
            raise ValueError(f"{len(tile_list)} tiles exceed the {num_tiles} a graph launches")
        tile_list.extend((0, 0, 0, 0) for _ in range(num_tiles - len(tile_list)))
    tiles = np.asarray(tile_list, dtype=np.int32).reshape(-1, 4)
    return StepPlan(tokens, positions, slots, tables, tiles, starts, n)


def reference_attention(q, k_flat, v_flat, plan: StepPlan, block_size: int, sliding: bool, window: int,
                        scale: float, rows: Sequence[int] | None = None):
    """What the paged kernel computes, in plain torch (float32 softmax): the
    attention output ``(width, heads, hd)`` of ``q (width, heads, hd)`` over
    the flattened cache ``(slots, kv_heads, hd)``, tile by tile."""
    import torch

    out = torch.zeros_like(q)
    group = q.shape[1] // k_flat.shape[1]
    for seq, row0, nrows, pos0 in plan.tiles.tolist():
        if nrows == 0:
            continue
        lo = max(0, pos0 - window + 1) if sliding else 0
        keys = torch.arange(lo, pos0 + nrows)
        table = torch.as_tensor(plan.tables[seq], dtype=torch.long)
        slots = table[keys // block_size] * block_size + keys % block_size
        k = k_flat[slots].repeat_interleave(group, dim=1)
        v = v_flat[slots].repeat_interleave(group, dim=1)
        qpos = torch.arange(pos0, pos0 + nrows)
        mask = keys[None, :] <= qpos[:, None]
        if sliding:
            mask &= (qpos[:, None] - keys[None, :]) < window
        scores = torch.einsum("lhd,shd->hls", q[row0:row0 + nrows].float(), k.float()) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[row0:row0 + nrows] = torch.einsum("hls,shd->lhd", probs, v.float()).to(q.dtype)
    return out

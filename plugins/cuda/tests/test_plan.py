"""The host side of the CUDA path, without a GPU: step plans (rows, slots,
block tables, tiles, padding) and the attention they describe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.engine.executor import ExecutorLimits, SeqChunk, Step
from musegl_cuda.model import sdpa_rows
from musegl_cuda.plan import plan_step, reference_attention, rows_per_tile
from musegl_cuda.plugin import parse_forward_sizes
from musegl_core.errors import ConfigError

BS = 4


def mixed_step() -> Step:
    return Step([SeqChunk(1, [5, 6, 7, 8, 9], [6, 7, 8, 9, 10], [3, 9, 4]),     # a chunk past position 0
                 SeqChunk(2, [11], [13], [0, 1, 2, 7]),                       # a decode row
                 SeqChunk(3, list(range(20, 29)), list(range(9)), [5, 6, 8])])  # a fresh prefill


def test_plan_rows_slots_tables_and_tiles():
    plan = plan_step(mixed_step(), BS, 10, 100, tile_rows=2)
    assert plan.starts == [0, 5, 6] and plan.num_tokens == plan.width == 15
    assert plan.tokens.tolist() == [5, 6, 7, 8, 9, 11] + list(range(20, 29))
    assert plan.positions.tolist() == [6, 7, 8, 9, 10, 13] + list(range(9))
    # position p of a chunk writes block blocks[p // BS] at offset p % BS
    assert plan.slots[:6].tolist() == [9 * 4 + 2, 9 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2, 7 * 4 + 1]
    assert plan.slots[6:].tolist() == [20, 21, 22, 23, 24, 25, 26, 27, 32]
    assert plan.tables.tolist() == [[3, 9, 4, 0], [0, 1, 2, 7], [5, 6, 8, 0]]
    assert plan.tiles.tolist() == [[0, 0, 2, 6], [0, 2, 2, 8], [0, 4, 1, 10], [1, 5, 1, 13],
                                   [2, 6, 2, 0], [2, 8, 2, 2], [2, 10, 2, 4], [2, 12, 2, 6], [2, 14, 1, 8]]


def test_padding_rows_write_only_the_scratch_block_and_tiles_pad_to_the_grid():
    limits = ExecutorLimits(64, (1, 2, 4, 8))
    decode = Step([SeqChunk(i, [3], [17 + i], [2 * i, 2 * i + 1, 20 + i, 30 + i, 40 + i], sample=1)
                   for i in range(3)], width=limits.padded_width(3))
    assert decode.width == 4
    plan = plan_step(decode, BS, 50, 100, tile_rows=1, width=decode.width, scratch_block=50, num_tiles=4)
    assert plan.width == 4 and plan.num_tokens == 3
    assert plan.slots[3] == 50 * BS and plan.tables[3, 0] == 50 and plan.tables.shape == (4, 5)
    assert plan.tiles.tolist() == [[0, 0, 1, 17], [1, 1, 1, 18], [2, 2, 1, 19], [3, 3, 1, 0]]
    plan = plan_step(Step([SeqChunk(0, [1, 2, 3], [0, 1, 2], [1], sample=3)], width=4), BS, 50, 100, tile_rows=4,
                     width=4, scratch_block=50, num_tiles=4)
    assert plan.tiles.tolist() == [[0, 0, 3, 0], [1, 3, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_plan_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="needs block"):
        plan_step(Step([SeqChunk(0, [1], [8], [0, 1])]), BS, 10, 100, 1)
    with pytest.raises(ValueError, match="block ids"):
        plan_step(Step([SeqChunk(0, [1], [0], [10])]), BS, 10, 100, 1)
    with pytest.raises(ValueError, match="vocabulary"):
        plan_step(Step([SeqChunk(0, [100], [0], [0])]), BS, 10, 100, 1)
    with pytest.raises(ValueError, match="consecutive"):
        plan_step(Step([SeqChunk(0, [1, 2], [0, 2], [0])]), BS, 10, 100, 1)
    with pytest.raises(ValueError, match="columns"):
        plan_step(Step([SeqChunk(0, [1], [12], [0, 1, 2, 3])]), BS, 10, 100, 1, cols=2)


@pytest.mark.parametrize("tile_rows", [1, 2, 4])
@pytest.mark.parametrize("sliding", [False, True])
def test_plan_attention_equals_the_per_sequence_path(tile_rows, sliding):
    """The tiles of a plan, read through its tables, give exactly the eager
    per-sequence attention (causal, window 3, GQA 4:2)."""
    torch.manual_seed(0)
    heads, kvh, hd, window = 4, 2, 8, 3
    cache_k, cache_v = torch.randn(11 * BS, kvh, hd), torch.randn(11 * BS, kvh, hd)
    step = mixed_step()
    plan = plan_step(step, BS, 10, 100, tile_rows, width=17, scratch_block=10)
    q = torch.randn(plan.width, heads, hd)
    got = reference_attention(q, cache_k, cache_v, plan, BS, sliding, window, hd ** -0.5)
    for chunk, start in zip(step.chunks, plan.starts):
        last = chunk.positions[-1]
        keys = torch.arange(last + 1)
        table = torch.tensor(list(chunk.blocks))
        slots = table[keys // BS] * BS + keys % BS
        qpos = torch.tensor(list(chunk.positions))
        mask = keys[None] <= qpos[:, None]
        if sliding:
            mask &= (qpos[:, None] - keys[None]) < window
        rows = slice(start, start + len(chunk.tokens))
        want = sdpa_rows(q[rows], cache_k[slots].repeat_interleave(2, 1), cache_v[slots].repeat_interleave(2, 1),
                         mask, hd ** -0.5)
        assert torch.allclose(got[rows], want, atol=1e-6)


def test_rows_per_tile_and_forward_sizes_option():
    assert rows_per_tile(16, 16) == 1 and rows_per_tile(128, 16) == 8 and rows_per_tile(16, 4) == 4
    assert parse_forward_sizes(None) is None
    assert parse_forward_sizes("none") == ()
    assert parse_forward_sizes("8,1,2,2") == (1, 2, 8)
    for bad in ("0,1", "a,b", ""):
        with pytest.raises(ConfigError):
            parse_forward_sizes(bad)
    assert np.array_equal(np.arange(3), [0, 1, 2])

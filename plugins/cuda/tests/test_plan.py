"""The host side of the CUDA path, without a GPU: step plans (rows, slots,
block tables, tiles, padding) and the attention they describe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.engine.executor import ExecutorLimits, SeqChunk, Step
from musegl_cuda.model import sdpa_rows
from musegl_cuda.cuda.plan import plan_step, reference_attention, rows_per_tile
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


class _Staged:
    """What the decode graphs would read after a staging: the device buffers, rows ``0..width-1``."""

    def __init__(self, graphs, width: int) -> None:
        self.tokens = graphs.tokens[:width].tolist()
        self.positions = graphs.positions[:width].tolist()
        self.slots = graphs.slots[:width].tolist()
        self.tiles = graphs.tiles[:width].tolist()
        self.tables = graphs.tables.clone()


def assert_staged_like_the_plan(graphs, step: Step, width: int, nb: int) -> None:
    """The graph inputs a staging leaves equal what plan_step makes of the same step (the
    table of a tile's sequence compared over the blocks its positions use)."""
    plan = plan_step(step, BS, nb, 1000, 1, width=width, scratch_block=nb, num_tiles=width)
    got = _Staged(graphs, width)
    assert got.tokens == plan.tokens.tolist()
    assert got.positions == plan.positions.tolist()
    assert got.slots == plan.slots.tolist()
    for r, ((seq, row0, rows, pos0), (pseq, prow0, prows, ppos0)) in enumerate(zip(got.tiles, plan.tiles.tolist())):
        assert (row0, rows, pos0) == (prow0, prows, ppos0), r
        used = pos0 // BS + 1
        assert got.tables[seq, :used].tolist() == plan.tables[pseq, :used].tolist(), r


def test_decode_staging_fills_the_graph_inputs_like_a_plan():
    """DecodeGraphs.stage_decode (the fast path of a decode step, no plan) on CPU
    tensors: through width changes, new blocks, a copy-on-write block replaced in
    place, a planned step in between, and refused steps that change nothing."""
    from musegl_cuda.cuda.graphs import DecodeGraphs

    nb = 40
    graphs = DecodeGraphs(None, torch.zeros(1), (4, 8), BS, 8, 16, 1)
    graphs.reset(nb)
    tables = {1: [3, 9], 2: [0, 1, 2, 7, 15, 16], 3: [5, 6, 8], 4: [11, 12], 5: [20, 21, 22]}
    pos = {1: 6, 2: 13, 3: 2, 4: 5, 5: 9}

    def decode(seqs, width):
        step = Step([SeqChunk(s, [100 + s + pos[s]], [pos[s]], tables[s]) for s in seqs], width=width)
        assert graphs.stage_decode(step.chunks, width, nb, 1000)
        assert_staged_like_the_plan(graphs, step, width, nb)
        for s in seqs:
            pos[s] += 1

    decode([1, 2, 3], 4)
    decode([1, 2, 3], 4)                       # same layout: only tokens, positions and slots move
    tables[1] += [30, 31]                      # sequence 1 reaches position 8: its third block
    decode([1, 2, 3], 4)
    tables[2][3] = 33                          # copy-on-write: a block replaced inside the same list
    decode([1, 2, 3], 4)
    decode([4, 5, 1, 2, 3], 8)                 # more rows, another width
    decode([3, 1], 4)                          # fewer rows: rows 2 and 3 become padding again
    plan = plan_step(Step([SeqChunk(9, [1, 2, 3], [0, 1, 2], [14])]), BS, nb, 1000, 1, width=4,
                     scratch_block=nb, num_tiles=4)
    graphs.stage_plan(plan)                    # a planned (verification-style) step in between
    decode([3, 1], 4)
    decode([2, 4, 5, 1], 4)

    before = _Staged(graphs, 4)
    for bad in (Step([SeqChunk(1, [1000], [pos[1]], tables[1])], width=4),          # token outside the vocabulary
                Step([SeqChunk(1, [5], [pos[1] + 8], tables[1])], width=4),         # a block the table lacks
                Step([SeqChunk(2, [5], [pos[2]], [0, 1, 2, 99])], width=4)):       # a block id outside the pool
        with pytest.raises(ValueError):
            graphs.stage_decode(bad.chunks, 4, nb, 1000)
        after = _Staged(graphs, 4)
        assert (after.tokens, after.positions, after.slots, after.tiles) == \
            (before.tokens, before.positions, before.slots, before.tiles)
        assert torch.equal(after.tables, before.tables)
    # a position past the graphs' table width is not staged (the step runs without a graph)
    assert not graphs.stage_decode([SeqChunk(1, [5], [8 * BS], tables[1] + [1] * 9)], 4, nb, 1000)


def test_decode_staging_marks_following_rows_with_their_source_row():
    """A chunk that follows the previous step is staged as ``-1 - r`` (the graph reads
    its token from ``last_ids[r]``); the other rows keep their tokens, and a source
    row outside the graphs' rows is refused before anything is staged."""
    from musegl_cuda.cuda.graphs import DecodeGraphs

    nb = 40
    graphs = DecodeGraphs(None, torch.zeros(1), (4, 8), BS, 8, 16, 1)
    graphs.reset(nb)
    chunks = [SeqChunk(1, [0], [6], [3, 9], sample=1, follows=True), SeqChunk(2, [77], [2], [5], sample=1),
              SeqChunk(3, [0], [9], [20, 21, 22], sample=1, follows=True)]
    assert graphs.stage_decode(chunks, 4, nb, 1000, {0: 2, 2: 0})
    staged = _Staged(graphs, 4)
    assert staged.tokens[:3] == [-3, 77, -1]
    assert staged.positions[:3] == [6, 2, 9]
    with pytest.raises(ValueError, match="outside the graphs' rows"):
        graphs.stage_decode(chunks, 4, nb, 1000, {0: 8, 2: 0})
    assert _Staged(graphs, 4).tokens == staged.tokens
    with pytest.raises(ValueError, match="no source row"):
        graphs.stage_decode(chunks, 4, nb, 1000, {0: 1})
    assert _Staged(graphs, 4).tokens == staged.tokens


def test_decode_staging_of_long_tables_sends_only_the_new_columns():
    """At long contexts a decode step sends no whole block table: a table that grew
    sends its new column only (one box over the rows that changed), a sequence that
    moves to another row or has a block replaced sends its row again."""
    from musegl_cuda.cuda.graphs import DecodeGraphs

    cols, nb = 2048, 8000
    graphs = DecodeGraphs(None, torch.zeros(1), (4,), BS, cols, 16, 1)
    graphs.reset(nb)
    rng = np.random.default_rng(2)
    tables = {s: rng.permutation(nb)[:cols].tolist() for s in (1, 2, 3)}
    pos = {1: 6001, 2: 7002, 3: 5001}

    def decode(seqs):
        step = Step([SeqChunk(s, [7], [pos[s]], tables[s][:pos[s] // BS + 1]) for s in seqs], width=4)
        assert graphs.stage_decode(step.chunks, 4, nb, 1000)
        assert_staged_like_the_plan(graphs, step, 4, nb)
        for s in seqs:
            pos[s] += 1
        return graphs.table_box

    assert decode([1, 2, 3]) == (0, 3, 0, 7002 // BS + 1)  # first sight: every row whole
    assert decode([1, 2, 3]) is None                        # nothing new
    assert decode([1, 2, 3]) == (1, 2, 7004 // BS, 7004 // BS + 1)  # sequence 2 starts a block: that column
    pos[1], pos[3] = 6004, 5004  # both start a block: one box over their new columns
    assert decode([1, 2, 3]) == (0, 3, 5004 // BS, 6004 // BS + 1)
    tables[3][10] = nb - 1  # a block replaced (copy-on-write): its row again
    assert decode([1, 2, 3]) == (2, 3, 0, 5005 // BS + 1)
    assert decode([3, 1, 2])[2] == 0  # rows moved


def test_multi_row_staging_fills_the_graph_inputs_like_a_plan():
    """DecodeGraphs.stage_rows (decode-only steps of draft blocks, no plan) leaves the
    graph inputs plan_step makes of the same step (tiles of several rows included),
    sends only new table columns, and stage_decode steps before and after it still
    stage like their plans (the tile columns it rewrote are restored)."""
    from musegl_cuda.cuda.graphs import DecodeGraphs

    nb, tile_rows = 60, 2
    graphs = DecodeGraphs(None, torch.zeros(1), (4, 8), BS, 16, 16, 1)
    graphs.reset(nb)
    tables = {1: [3, 9, 30, 31, 32], 2: [0, 1, 2, 7, 15, 16, 17], 3: [5, 6, 8, 40, 41]}
    pos = {1: 6, 2: 13, 3: 2}

    def verify(rows: dict[int, int], width: int):
        step = Step([SeqChunk(s, [100 + s] * k, list(range(pos[s], pos[s] + k)), tables[s], sample=k)
                     for s, k in rows.items()], width=width)
        starts = graphs.stage_rows(step.chunks, width, nb, 1000, tile_rows)
        plan = plan_step(step, BS, nb, 1000, tile_rows, width=width, scratch_block=nb, num_tiles=width)
        assert starts == plan.starts
        got = _Staged(graphs, width)
        assert (got.tokens, got.positions, got.slots) == (plan.tokens.tolist(), plan.positions.tolist(),
                                                          plan.slots.tolist())
        for (seq, row0, nrows, pos0), (pseq, prow0, prows, ppos0) in zip(got.tiles, plan.tiles.tolist()):
            assert (row0, nrows, pos0) == (prow0, prows, ppos0)
            used = (pos0 + max(nrows, 1) - 1) // BS + 1
            assert got.tables[seq, :used].tolist() == plan.tables[pseq, :used].tolist()
        for s, k in rows.items():
            pos[s] += k
        return graphs.table_box

    def decode(seqs, width):
        step = Step([SeqChunk(s, [100 + s + pos[s]], [pos[s]], tables[s]) for s in seqs], width=width)
        assert graphs.stage_decode(step.chunks, width, nb, 1000)
        assert_staged_like_the_plan(graphs, step, width, nb)
        for s in seqs:
            pos[s] += 1

    assert verify({1: 3, 2: 4}, 8) == (0, 2, 0, 5)
    decode([1, 2, 3], 4)
    assert verify({1: 2, 2: 3, 3: 1}, 8) == (1, 2, 5, 6)  # sequence 2 reaches a new block: that column
    assert verify({1: 4, 2: 1, 3: 3}, 8) == (0, 3, 1, 4)  # sequences 1 and 3 do: one box over both
    decode([1, 2, 3], 4)
    decode([2, 3, 1], 4)
    with pytest.raises(ValueError):  # a block the table lacks: nothing staged
        graphs.stage_rows([SeqChunk(1, [5] * 3, list(range(pos[1], pos[1] + 3)), tables[1][:4])], 4, nb, 1000, 2)
    assert graphs.stage_rows([SeqChunk(1, [5], [16 * BS], tables[1] + [1] * 12)], 4, nb, 1000, 2) is None

"""The draft forward through :class:`~musegl_dflash.graphs.DraftGraphs`, on the CPU.

On the CPU nothing is captured: the graphs' staging fills their static inputs
(batch and context padded to the shape's powers of two; per block its anchor,
start and the block ids of its window, from which the body computes the keys'
slots as :func:`gather_context` lays them out) and the body a CUDA graph
records runs over them. Its drafts must be the unpadded forward's over
``gather_context``'s keys,
for batches and contexts of several sizes, with a window shorter than the
context and with full-attention layers (every earlier position a key); a shape
past the graphs' limits runs eagerly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import musegl_dflash.graphs as draft_graphs
from dflash_support import build_reference_draft, save_draft
from musegl_core.engine.speculator import DraftRequest
from musegl_dflash.graphs import BlockInputs, DraftGraphs, block_drafts
from musegl_dflash.loader import load_draft
from musegl_dflash.model import DraftBatch, gather_context
from musegl_dflash.speculator import DFlashSpeculator, TargetHead, block_drafts_for

VOCAB, HIDDEN, MASK, BLOCK = 512, 64, 500, 4


@pytest.fixture(scope="module", params=["window40", "full"])
def speculator(request, tmp_path_factory):
    overrides = dict(sliding_window=40) if request.param == "window40" else dict(
        layer_types=["full_attention", "sliding_attention"])
    model = build_reference_draft(seed=3, mask_token_id=MASK, **overrides)
    draft = load_draft(str(save_draft(model, tmp_path_factory.mktemp("draft"))), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(4)
    head = TargetHead.of_tensors(torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen))
    spec = DFlashSpeculator(draft, head, 5, BLOCK, graphs=True)
    spec.allocate_kv(80)
    c = draft.config
    for table, length in zip(TABLES, LENGTHS):  # every sequence's context, at scattered blocks
        positions = torch.arange(length)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        features = torch.randn(length, len(c.target_layer_ids) * HIDDEN, generator=gen)
        draft.write_context(features, positions, slots, spec.kv)
    return spec


TABLES = [list(range(40, 70)), list(range(5, 8)), list(range(10, 40))]
LENGTHS = [110, 9, 77]


def ask(lengths, room=5):
    return [DraftRequest(seq, [7 + seq] * (n + 1), TABLES[seq], room) for seq, n in lengths]


def reference(spec, requests, n=None):
    """The drafts of the unpadded forward over gather_context's keys (``n`` mask rows a block)."""
    starts = [len(r.tokens) - 1 for r in requests]
    slots, positions, valid = gather_context(spec.config, BLOCK, starts, [r.blocks for r in requests],
                                             torch.device("cpu"))
    batch = DraftBatch(torch.tensor([r.tokens[-1] for r in requests]), torch.tensor(starts), slots, positions, valid)
    with torch.inference_mode():
        return block_drafts(spec.draft, spec.target.rows, spec.target.logits, spec.kv, batch, n or spec.max_draft)


def eager(spec, requests):
    """The speculator without graphs."""
    graphs, spec.graphs = spec.graphs, None
    try:
        return spec.propose_on_device(requests)
    finally:
        spec.graphs = graphs


@pytest.mark.parametrize("lengths", [[(0, 110), (1, 9), (2, 77)], [(1, 9)], [(2, 30), (0, 0)]])
def test_padded_graph_inputs_give_the_eager_drafts(speculator, lengths):
    requests = ask(lengths)
    got = speculator.propose_on_device(requests)
    want = eager(speculator, requests)
    assert torch.equal(got.ids, want.ids)
    assert torch.equal(want.ids, reference(speculator, requests))
    assert got.rows == want.rows == {seq: i for i, (seq, _) in enumerate(lengths)}
    assert got.counts == want.counts == {seq: 5 for seq, _ in lengths}
    config = speculator.draft.config
    key = speculator.graphs.shape(len(lengths), draft_graphs.context_width(config, [n for _, n in lengths]))
    assert key in speculator.graphs.inputs
    assert key[0] >= len(lengths) and key[1] >= draft_graphs.MIN_CONTEXT
    assert speculator.propose(requests) == {r.seq: want.ids[i].tolist() for i, r in enumerate(requests)}


@pytest.mark.parametrize("reach", [None, 40, 5])
@pytest.mark.parametrize("padded", [False, True])
def test_block_inputs_lay_out_the_keys_like_gather_context(reach, padded):
    config = SimpleNamespace(sliding_window=reach, sliding=(reach is not None,))
    starts = [110, 0, 9, 77, 1]
    tables = [TABLES[0], TABLES[1], TABLES[1], TABLES[2], TABLES[2]]
    slots, positions, valid = gather_context(config, BLOCK, starts, tables, torch.device("cpu"))
    width, context = len(starts), slots.shape[1]
    layout = BlockInputs(8 if padded else width, 128 if padded else context, BLOCK, reach)
    host = np.full(layout.words, 99, dtype=np.int64)  # what an earlier staging left
    layout.write(host, [3, 4, 5, 6, 7], starts, tables)
    batch = layout.batch(torch.from_numpy(host))
    assert batch.anchors[:width].tolist() == [3, 4, 5, 6, 7] and batch.starts[:width].tolist() == starts
    assert torch.equal(batch.context_valid[:width, :context], valid)
    assert torch.equal(batch.context_slots[:width, :context], slots)
    assert torch.equal(batch.context_positions[:width, :context], positions)
    assert not batch.context_valid[width:].any() and not batch.context_valid[:, context:].any()
    assert not batch.anchors[width:].any() and not batch.starts[width:].any()


def test_shapes_are_powers_of_two_within_the_limits():
    graphs = DraftGraphs.__new__(DraftGraphs)
    assert graphs.shape(3, 0) == (4, draft_graphs.MIN_CONTEXT)
    assert graphs.shape(1, 65) == (1, 128)
    assert graphs.shape(64, 2048) == (64, 2048)
    assert graphs.shape(draft_graphs.MAX_WIDTH + 1, 10) is None
    assert graphs.shape(2, draft_graphs.MAX_CONTEXT + 1) is None


def test_a_shape_past_the_limits_runs_eagerly(speculator, monkeypatch):
    monkeypatch.setattr(draft_graphs, "MAX_CONTEXT", 8)
    requests = ask([(0, 110), (2, 77)])
    before = set(speculator.graphs.inputs)
    assert speculator.graphs.run([1, 2], [110, 77], [TABLES[0], TABLES[2]], speculator.kv) is None
    assert torch.equal(speculator.propose_on_device(requests).ids, eager(speculator, requests).ids)
    assert set(speculator.graphs.inputs) == before


def test_blocks_shrink_to_what_the_budget_lets_a_step_verify(speculator):
    """Requests that may verify fewer drafts than the speculator's 5 (the engine's verify-rows
    budget) get blocks of fewer mask rows: the largest count rounded up to a power of two."""
    assert [block_drafts_for(ask([(0, 9)], room=k), 5) for k in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]
    assert block_drafts_for(ask([(0, 9), (1, 9)], room=1) + ask([(2, 9)], room=3), 15) == 4
    for room, n in ((1, 1), (2, 2), (3, 4)):
        requests = ask([(0, 110), (1, 9), (2, 77)], room=room)
        got = speculator.propose_on_device(requests)
        assert got.ids.shape == (3, n)
        assert got.counts == {seq: room for seq in range(3)}
        assert torch.equal(got.ids, eager(speculator, requests).ids)
        assert torch.equal(got.ids, reference(speculator, requests, n))
        key = speculator.graphs.shape(3, draft_graphs.context_width(speculator.draft.config, [110, 9, 77]))
        assert speculator.graphs.out(n).shape == (draft_graphs.MAX_WIDTH, n)
        assert key in speculator.graphs.inputs
    with pytest.raises(ValueError, match="6 drafts a block; this speculator drafts 1 .. 5"):
        speculator.graphs.run([1], [9], [TABLES[1]], speculator.kv, 6)

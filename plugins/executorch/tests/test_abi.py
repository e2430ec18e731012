"""The off-graph ABI in eager torch (no export): the export module driven by the
host-side call planner gives the torch executor's logits, for prefill split into
pieces, a decode batch with padding groups, sliding windows and shared blocks."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.executor import TorchExecutor
from musegl_executorch.abi import plan_calls
from musegl_executorch.export.graph import OffGraphDecoder

BLOCKS = 64


@pytest.fixture(scope="module")
def pair(tiny_hf):
    checkpoint = load_checkpoint(tiny_hf.path)
    reference = TorchExecutor(checkpoint, device="cpu")
    reference.allocate_kv(BLOCKS)
    module = OffGraphDecoder.from_decoder(reference.model, torch.float32)
    c = reference.config
    shape = (c.num_layers, BLOCKS * 16, c.num_kv_heads, c.head_dim)
    return reference, module, torch.zeros(shape), torch.zeros(shape)


def run(pair, chunks, sizes=(1, 2, 4), max_chunk=16, wanted=None, min_head_rows=1):
    """Logits of the ``wanted`` rows of each chunk (default: every row) through the ABI,
    writing the pools as the executor does."""
    reference, module, k_pool, v_pool = pair
    c = reference.config
    wanted = [list(range(len(ch.tokens))) for ch in chunks] if wanted is None else wanted
    out = {}
    calls = plan_calls(chunks, wanted, block_size=16, num_blocks=BLOCKS, window=c.sliding_window,
                       vocab=c.vocab_size, sizes=sizes, max_chunk=max_chunk, min_head_rows=min_head_rows)
    for call in calls:
        i = {k: torch.from_numpy(v) for k, v in call.inputs.items()}
        logits, new_k, new_v = module(i["tokens"], i["positions"], k_pool, v_pool, i["full_slots"],
                                      i["full_bias"], i["window_slots"], i["window_bias"], i["head_rows"])
        real = torch.from_numpy(np.flatnonzero(call.write_slots >= 0))
        at = torch.from_numpy(call.write_slots)[real]
        k_pool[:, at] = new_k[:, real]
        v_pool[:, at] = new_v[:, real]
        for key, j in call.head_of.items():
            out[key] = logits[j]
    return calls, out


def reference_logits(pair, chunks):
    """The torch executor's logits of every row (it writes its own cache, same block ids)."""
    return pair[0].step(Step(chunks=[attrs.evolve(ch, logit_rows=True, sample=0) for ch in chunks])).logits


def test_prefill_in_pieces_then_batched_decode_match_the_torch_executor(pair):
    rng = np.random.default_rng(0)
    prompt_a = rng.integers(0, 512, 40).tolist()  # 3 pieces of at most 16 rows, past the 8-key window
    prompt_b = rng.integers(0, 512, 5).tolist()
    a = SeqChunk(seq=1, tokens=prompt_a, positions=list(range(40)), blocks=[10, 11, 12], sample=1)
    b = SeqChunk(seq=2, tokens=prompt_b, positions=list(range(5)), blocks=[20], sample=1)
    calls, mine = run(pair, [a, b])
    assert [c.method for c in calls] == ["forward_others"] * 4  # 16 + 16 + 8 rows, then 5
    ref = reference_logits(pair, [a, b])
    assert torch.allclose(torch.stack([mine[(0, r)] for r in range(40)]), ref[1], atol=1e-4)
    assert torch.allclose(torch.stack([mine[(1, r)] for r in range(5)]), ref[2], atol=1e-4)

    # three decode rows: forward_4 with one padding group; c reads a's first block
    # (a shared prefix, as a session's snapshot would)
    c = SeqChunk(seq=3, tokens=[9], positions=[16], blocks=[10, 30], sample=1)
    decode = [SeqChunk(seq=1, tokens=[7], positions=[40], blocks=[10, 11, 12], sample=1),
              SeqChunk(seq=2, tokens=[8], positions=[5], blocks=[20], sample=1), c]
    calls, mine = run(pair, decode)
    assert [call.method for call in calls] == ["forward_4"]
    assert (calls[0].write_slots == -1).sum() == 1  # the padding row is never written
    ref = reference_logits(pair, decode)
    for index, chunk in enumerate(decode):
        assert torch.allclose(mine[(index, 0)], ref[chunk.seq][0], atol=1e-4)


def test_pieces_that_sample_nothing_skip_the_head_when_the_export_allows_it(pair):
    """``min_head_rows=0`` (an export whose prefill methods take an empty head axis): the
    pieces before the sampled row pass no head row, the last piece's logits are unchanged."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, 40).tolist()
    chunks = [SeqChunk(seq=4, tokens=prompt, positions=list(range(40)), blocks=[50, 51, 52], sample=1)]
    ref = reference_logits(pair, chunks)[4][39]
    for floor, dummy_rows in ((1, [1, 1]), (0, [0, 0])):
        calls, mine = run(pair, chunks, wanted=[[39]], min_head_rows=floor)
        assert [len(call.inputs["head_rows"]) for call in calls] == dummy_rows + [1]
        # the ExecuTorch runtime refuses a tensor whose strides are not the contiguous ones
        assert all(torch.from_numpy(call.inputs["head_rows"]).stride() == (1,) for call in calls)
        assert torch.allclose(mine[(0, 39)], ref, atol=1e-4)
    # a decode row through forward_{N} still runs the head when nothing is sampled
    calls, _ = run(pair, [SeqChunk(seq=4, tokens=[1], positions=[40], blocks=[50, 51, 52], sample=0)],
                   wanted=[[]], min_head_rows=0)
    assert [(call.method, len(call.inputs["head_rows"])) for call in calls] == [("forward_1", 1)]


def test_more_decode_rows_than_the_widest_method_take_several_calls(pair):
    chunks = [SeqChunk(seq=10 + i, tokens=[i], positions=[0], blocks=[40 + i], sample=1) for i in range(6)]
    calls, mine = run(pair, chunks, sizes=(1, 4))
    assert [c.method for c in calls] == ["forward_4", "forward_4"]
    ref = reference_logits(pair, chunks)
    for index, chunk in enumerate(chunks):
        assert torch.allclose(mine[(index, 0)], ref[chunk.seq][0], atol=1e-4)


def test_a_block_table_too_short_or_out_of_range_is_refused(pair):
    with pytest.raises(ValueError, match="needs block 1"):
        run(pair, [SeqChunk(seq=1, tokens=[1, 2], positions=[15, 16], blocks=[3], sample=1)])
    with pytest.raises(ValueError, match="block ids must lie in"):
        run(pair, [SeqChunk(seq=1, tokens=[1], positions=[0], blocks=[BLOCKS], sample=1)])


def test_the_sliding_pages_graph_reads_each_group_s_pages(tiny_hf):
    """A module set for sliding pages (``--sliding-pages``: pools of places, one set of window
    cells per sliding group) driven by the planner with each group's own pages, the full layers'
    and each sliding group's at other ids, gives the torch executor's logits; a ``keep_full``
    chunk writes no full layer's row; the same program keeping every position (each group's
    fixed page ``b + g x blocks``) does too."""
    from musegl_core.engine.sliding_pages import PageGroups
    from musegl_executorch.abi import Pages
    from musegl_executorch.executor import write_rows

    checkpoint = load_checkpoint(tiny_hf.path)
    reference = TorchExecutor(checkpoint, device="cpu")
    reference.allocate_kv(BLOCKS)
    c = reference.config
    groups = PageGroups.of(c.sliding)
    assert (groups.places, groups.sliding_groups) == (2, 2)  # 6 layers, 4 sliding: 3 groups of 2
    module = OffGraphDecoder.from_decoder(reference.model, torch.float32)
    module.use_page_groups(groups)
    layers = [torch.tensor(sorted((i for i, (g, _) in enumerate(groups.layers) if g == group),
                                  key=lambda i: groups.layers[i][1])) for group in range(3)]

    def drive(chunks, pages, pool_pages, pools):
        k_pool, v_pool = pools
        out = {}
        for call in plan_calls(chunks, [list(range(len(ch.tokens))) for ch in chunks], block_size=16,
                               num_blocks=pool_pages, window=c.sliding_window, vocab=c.vocab_size, sizes=(1, 4),
                               max_chunk=16, pages=pages):
            i = {k: torch.from_numpy(v) for k, v in call.inputs.items()}
            assert i["window_slots"].shape[0] == 2  # one set of window cells per sliding group
            logits, new_k, new_v = module(i["tokens"], i["positions"], k_pool, v_pool, i["full_slots"],
                                          i["full_bias"], i["window_slots"], i["window_bias"], i["head_rows"])
            for group, slots in enumerate([call.write_slots, *call.sliding_writes]):
                write_rows(k_pool, v_pool, new_k, new_v, layers[group], slots)
            for key, j in call.head_of.items():
                out[key] = logits[j]
        return out

    def pools(pages):
        shape = (groups.places, pages * 16, c.num_kv_heads, c.head_dim)
        return torch.zeros(shape), torch.zeros(shape)

    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 512, 40).tolist()
    blocks, sliding = [3, 7, 1], ([12, 5, 9], [20, 14, 2])  # each group's pages of the three blocks
    prefill = SeqChunk(seq=1, tokens=prompt, positions=list(range(40)), blocks=blocks, sliding_blocks=sliding,
                       sample=1)
    decode = SeqChunk(seq=1, tokens=[7], positions=[40], blocks=blocks, sliding_blocks=sliding, sample=1)
    ref_prefill = reference_logits((reference,), [prefill])[1]
    ref_decode = reference_logits((reference,), [decode])[1][0]
    paged = pools(32)
    mine = drive([prefill], Pages(2), 32, paged)
    assert torch.allclose(torch.stack([mine[(0, r)] for r in range(40)]), ref_prefill, atol=1e-4)
    assert torch.allclose(drive([decode], Pages(2), 32, paged)[(0, 0)], ref_decode, atol=1e-4)
    # pages out of every window are never read: -1 there changes nothing
    gone = SeqChunk(seq=1, tokens=[7], positions=[40], blocks=blocks, sliding_blocks=([-1, 5, 9], [-1, 14, 2]),
                    sample=1)
    assert torch.allclose(drive([gone], Pages(2), 32, paged)[(0, 0)], ref_decode, atol=1e-4)
    # a rewind's recomputation: the full layers' cells stay as they are
    full_page = paged[0][:, 7 * 16:8 * 16].clone()  # the full layers' page of positions 16..31, both places
    paged[0][:, 25 * 16:27 * 16] = 0
    again = SeqChunk(seq=1, tokens=prompt[16:32], positions=list(range(16, 32)), blocks=blocks,
                     sliding_blocks=([12, 25, 9], [20, 26, 2]), sample=0, keep_full=True)
    drive([again], Pages(2), 32, paged)
    assert torch.equal(paged[0][:, 7 * 16:8 * 16], full_page)
    # the recomputation wrote its own sliding pages, as the first pass wrote pages 5 and 14
    assert torch.allclose(paged[0][:, 25 * 16:26 * 16], paged[0][:, 5 * 16:6 * 16], atol=1e-5)
    assert torch.allclose(paged[1][:, 26 * 16:27 * 16], paged[1][:, 14 * 16:15 * 16], atol=1e-5)
    # every position kept: sliding group g's page of block b is b + g x 16
    kept = pools(48)
    fixed = drive([attrs.evolve(prefill, sliding_blocks=())], Pages(2, fixed=16), 48, kept)
    assert torch.allclose(torch.stack([fixed[(0, r)] for r in range(40)]), ref_prefill, atol=1e-4)

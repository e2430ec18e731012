"""The draft model against transformers' ``MuseGlimmerAssistantModel`` (float32).

transformers runs the way its DFlash candidate generator does: a
``DFlashCache``, the new context rows and the 16-row block in one forward,
then the block cropped before the next step. musegl's draft writes the same
context into a paged store (scattered block ids) and drafts from it. The
candidate logits (raw lm_head over the mask rows) must agree within 1e-4, for
the first step (the whole prompt) and a later step (a few accepted rows),
loading the draft from a Hugging Face directory and from a DFlash GGUF, with
a window longer and shorter than the block.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from dflash_support import build_reference_draft, save_draft
from musegl_dflash.checkpoint import DraftCheckpoint, read_draft_config
from musegl_dflash.loader import load_draft
from musegl_dflash.model import DraftBatch, gather_context

VOCAB, HIDDEN, MASK = 512, 64, 500
BLOCK_SIZE = 4  # the paged store's positions per block
PROMPT, ACCEPTED = 40, 5


def reference_logits(model, embed, head, steps):
    """Candidate logits of each step, as transformers' DFlash generator computes them."""
    from transformers.cache_utils import DFlashCache

    cache = DFlashCache(config=model.config)
    cache.activate_past_recording()
    start, out = 0, []
    for index, (context, anchor) in enumerate(steps):
        if index:
            cache.crop(-model.config.block_size)
        cache.set_previous_accepted_tokens(len(context))
        ids = torch.tensor([anchor] + [MASK] * (model.config.block_size - 1))
        positions = torch.arange(start, start + len(context) + model.config.block_size)[None]
        with torch.no_grad():
            hidden = model(noise_embeds=embed[ids][None], context_hidden_states=context[None], position_ids=positions,
                           past_key_values=cache).last_hidden_state
        out.append(hidden[0, 1:] @ head.T)
        start += len(context)
    return out


def musegl_logits(draft, embed, head, steps, table):
    """The same steps through the paged store and the batched block forward."""
    c = draft.config
    kv = torch.zeros(c.num_layers, 2, (max(table) + 1) * BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    start, out = 0, []
    for context, anchor in steps:
        positions = torch.arange(start, start + len(context))
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions.tolist()])
        draft.write_context(context, positions, slots, kv)
        start += len(context)
        slot_ids, pos, valid = gather_context(c, BLOCK_SIZE, [start], [table], torch.device("cpu"))
        ids = torch.tensor([[anchor] + [MASK] * (c.block_size - 1)])
        batch = DraftBatch(ids[:, 0], torch.tensor([start]), slot_ids, pos, valid)
        with torch.no_grad():
            hidden = draft.hidden(embed[ids], batch, kv)
        out.append(hidden[0, 1:] @ head.T)
    return out


@pytest.fixture(scope="module", params=[2048, 8], ids=["window2048", "window8"])
def reference(request):
    model = build_reference_draft(seed=1, mask_token_id=MASK, sliding_window=request.param)
    gen = torch.Generator().manual_seed(2)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    width = len(model.config.target_layer_ids) * HIDDEN
    steps = [(torch.randn(PROMPT, width, generator=gen), 7), (torch.randn(ACCEPTED, width, generator=gen), 11),
             (torch.randn(1, width, generator=gen), 13)]
    return model, embed, head, steps, reference_logits(model, embed, head, steps)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_draft_logits_match_transformers(reference, form, tmp_path):
    model, embed, head, steps, expected = reference
    path = save_draft(model, tmp_path / form, gguf=form == "gguf")
    draft = load_draft(str(path), torch.device("cpu"), torch.float32)
    table = list(np.random.default_rng(3).permutation(40)[:20])  # scattered block ids
    got = musegl_logits(draft, embed, head, steps, table)
    for step, (ours, theirs) in enumerate(zip(got, expected)):
        assert (ours - theirs).abs().max().item() < 1e-4, f"step {step}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_gguf_and_hf_read_the_same_config_and_weights(reference, tmp_path):
    model = reference[0]
    hf, gguf = save_draft(model, tmp_path / "hf"), save_draft(model, tmp_path / "gguf", gguf=True)
    from_gguf = read_draft_config(gguf)  # the GGUF stores epsilon as float32
    assert from_gguf.rms_norm_eps == pytest.approx(read_draft_config(hf).rms_norm_eps)
    assert attrs.evolve(from_gguf, rms_norm_eps=read_draft_config(hf).rms_norm_eps) == read_draft_config(hf)
    assert read_draft_config(gguf).taps == tuple(i + 1 for i in model.config.target_layer_ids)
    a, b = DraftCheckpoint(hf), DraftCheckpoint(gguf)
    try:
        for (name_a, wa), (name_b, wb) in zip(a.iter_weights(), b.iter_weights()):
            assert name_a == name_b and np.array_equal(wa, wb)
    finally:
        a.close()
        b.close()


def test_blocks_of_several_sequences_in_one_forward_equal_each_alone(reference, tmp_path):
    model, embed, head, steps, _ = reference
    draft = load_draft(str(save_draft(model, tmp_path / "hf")), torch.device("cpu"), torch.float32)
    c = draft.config
    kv = torch.zeros(c.num_layers, 2, 64 * BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    tables = [list(range(0, 20)), list(range(40, 60))]
    lengths = [PROMPT, 9]
    gen = torch.Generator().manual_seed(5)
    for table, length in zip(tables, lengths):
        context = torch.randn(length, len(c.target_layer_ids) * HIDDEN, generator=gen)
        positions = torch.arange(length)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)])
        draft.write_context(context, positions, slots, kv)

    def forward(which):
        slot_ids, pos, valid = gather_context(c, BLOCK_SIZE, [lengths[i] for i in which],
                                              [tables[i] for i in which], torch.device("cpu"))
        ids = torch.tensor([[[3, 4][i]] + [MASK] * (c.block_size - 1) for i in which])
        batch = DraftBatch(ids[:, 0], torch.tensor([lengths[i] for i in which]), slot_ids, pos, valid)
        with torch.no_grad():
            return draft.hidden(embed[ids], batch, kv)

    both = forward([0, 1])
    assert torch.allclose(both[0], forward([0])[0], atol=1e-5)
    assert torch.allclose(both[1], forward([1])[0], atol=1e-5)


def test_context_rows_of_every_layer_at_once_are_the_layer_by_layer_values(reference, tmp_path):
    """write_context runs all layers' K/V projections as one product: each layer's stored
    K (normed, rotated) and V are what context_kv computes for that layer alone."""
    model, _embed, _head, steps, _expected = reference
    draft = load_draft(str(save_draft(model, tmp_path / "hf")), torch.device("cpu"), torch.float32)
    c = draft.config
    features = steps[0][0][:9]
    positions = torch.tensor([3, 4, 5, 6, 7, 30, 31, 32, 33])
    slots = torch.tensor([17, 2, 9, 30, 31, 5, 0, 22, 12])
    kv = torch.full((c.num_layers, 2, 40, c.num_kv_heads, c.head_dim), 7.0)
    draft.write_context(features, positions, slots, kv)
    g = draft.project_context(features)
    cos, sin = draft.rope(positions)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    for i in range(c.num_layers):
        k, v = draft.context_kv(i, g, cos, sin)
        torch.testing.assert_close(kv[i, 0, slots], k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kv[i, 1, slots], v, rtol=1e-5, atol=1e-6)
        assert torch.all(kv[i, :, untouched] == 7.0)

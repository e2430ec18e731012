"""The DFlash export modules in eager torch (no export, default tier): the tapped
target rows of the off-graph decoder are the torch executor's, and the program's
drafter (``draft_context`` + ``draft_block`` driven by :class:`ProgramDrafter`)
drafts what the eager DFlash speculator drafts, over a prefill and a later
step, with sliding and full draft layers, several owners split across calls,
a block shorter than the trained one and scattered block ids."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.engine.executor import SeqChunk, Step, StepOutput
from musegl_core.engine.speculator import DraftRequest
from musegl_cuda.executor import TorchExecutor
from musegl_dflash.checkpoint import config_from_dict
from musegl_dflash.model import DFlashDraft
from musegl_dflash.speculator import DFlashSpeculator, TargetHead
from musegl_executorch.abi import plan_calls
from musegl_executorch.artifact import DFlashExport
from musegl_executorch.drafter import ProgramDrafter
from musegl_executorch.export.draft import DraftBlock, DraftContext, DraftWeights
from musegl_executorch.export.graph import EmbedText, FromEmbeddings, OffGraphDecoder
from musegl_executorch.export.lower import DRAFT_BLOCK, DRAFT_CONTEXT, example_inputs

BLOCKS = 32
TAPS_IDS = [0, 2, 5]  # transformers' target_layer_ids: taps 1, 3 and 6 (6: the last layer's output)


@pytest.fixture(scope="module")
def target(tiny_hf):
    checkpoint = load_checkpoint(tiny_hf.path)
    reference = TorchExecutor(checkpoint, device="cpu")
    reference.allocate_kv(BLOCKS)
    module = OffGraphDecoder.from_decoder(reference.model, torch.float32)
    return reference, module


@pytest.fixture(scope="module")
def draft():
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(3)
    config = MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=5, block_size=6, mask_token_id=500, target_layer_ids=TAPS_IDS,
        max_position_embeddings=4096, layer_types=["sliding_attention", "full_attention"])
    model = MuseGlimmerAssistantModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.2) if name.endswith("norm.weight") or name.endswith("norm_enc.weight") \
                else param.normal_(0.0, 0.1)
    eager = DFlashDraft(config_from_dict(config.to_dict()), torch.float32, torch.device("cpu"))
    for name, value in model.state_dict().items():
        eager.load_weight(name, value)
    return eager


class EagerProgram:
    """The two draft methods run as the eager export modules, behind the executor's
    ``execute`` (what :class:`ProgramDrafter` calls on the loaded program)."""

    def __init__(self, module: OffGraphDecoder, draft: DFlashDraft, max_chunk: int) -> None:
        weights = DraftWeights.from_draft(draft, torch.float32)
        self.methods = {DRAFT_CONTEXT: DraftContext(weights), DRAFT_BLOCK: DraftBlock(weights, module)}
        self.block_size, self.dtype = 16, torch.float32
        self.manifest = attrs.make_class("M", ["limits"])(attrs.make_class("L", ["max_prefill_chunk"])(max_chunk))

    def execute(self, method, inputs):
        with torch.no_grad():
            out = self.methods[method](*inputs)
        return out if isinstance(out, tuple) else (out,)


def tapped_rows(module, chunks, taps):
    """Every row's tapped residuals through the ABI, by sequence (the pools written per call)."""
    c = module.config
    shape = (c.num_layers, BLOCKS * 16, c.num_kv_heads, c.head_dim)
    k_pool, v_pool = torch.zeros(shape), torch.zeros(shape)
    module.taps = taps
    out: dict[int, list] = {}
    calls = plan_calls(chunks, [[] for _ in chunks], block_size=16, num_blocks=BLOCKS, window=c.sliding_window,
                       vocab=c.vocab_size, sizes=(1, 2), max_chunk=8)
    for call in calls:
        i = {k: torch.from_numpy(v) for k, v in call.inputs.items()}
        with torch.no_grad():
            _, new_k, new_v, hidden = module(i["tokens"], i["positions"], k_pool, v_pool, i["full_slots"],
                                             i["full_bias"], i["window_slots"], i["window_bias"], i["head_rows"])
        real = torch.from_numpy(np.flatnonzero(call.write_slots >= 0))
        at = torch.from_numpy(call.write_slots)[real]
        k_pool[:, at], v_pool[:, at] = new_k[:, real], new_v[:, real]
        rows = call.inputs["tokens"].shape[1]
        for g, piece in enumerate(call.pieces):
            out.setdefault(piece.chunk, []).append(hidden[:, g * rows:g * rows + piece.hi - piece.lo])
    module.taps = ()
    return {index: torch.cat(parts, dim=1) for index, parts in out.items()}


def test_the_tapped_rows_are_the_torch_executors(target):
    reference, module = target
    rng = np.random.default_rng(1)
    taps = (1, 3, 6)
    chunks = [SeqChunk(seq=1, tokens=rng.integers(0, 500, 19).tolist(), positions=list(range(19)), blocks=[4, 9],
                       sample=1),
              SeqChunk(seq=2, tokens=[7], positions=[0], blocks=[12], sample=1)]
    mine = tapped_rows(module, chunks, taps)
    theirs = reference.step(Step(chunks=chunks, taps=taps)).hidden
    assert mine[0].shape == (3, 19, 64) and mine[1].shape == (3, 1, 64)
    assert torch.allclose(mine[0], theirs[1], atol=1e-4) and torch.allclose(mine[1], theirs[2], atol=1e-4)


def test_forward_from_embeddings_returns_the_same_taps(target):
    """``--mmproj`` with ``--dflash``: the image prefill's method returns the taps too."""
    _, module = target
    inputs = list(example_inputs(module.config, torch.float32, groups=1, rows=5, cached=3, windowed=2, cells=32,
                                 heads=2))
    inputs[0] = torch.tensor([[5, 400, 17, 300, 42]])
    inputs[2], inputs[3] = torch.randn_like(inputs[2]), torch.randn_like(inputs[3])
    module.taps = (2, 6)
    try:
        with torch.no_grad():
            theirs = module(*inputs)
            mine = FromEmbeddings(module)(EmbedText(module)(inputs[0][0])[None], *inputs[1:])
    finally:
        module.taps = ()
    assert len(mine) == len(theirs) == 4 and theirs[3].shape == (2, 5, 64)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_the_program_drafter_drafts_what_the_eager_speculator_drafts(target, draft):
    reference, module = target
    config = draft.config
    head = TargetHead.of_tensors(module.embed_tokens.weight, module.lm_head.weight)
    for n_draft in (config.block_size - 1, 2):  # the trained block, and a shorter one chosen at serve time
        eager = DFlashSpeculator(draft, head, n_draft, 16)
        export = DFlashExport(config, max_owners=2, context_keys=4096)
        mine = ProgramDrafter(EagerProgram(module, draft, max_chunk=7), export, n_draft)
        for speculator in (eager, mine):
            speculator.allocate_kv(BLOCKS)
        rng = np.random.default_rng(n_draft)
        lengths, tables = (21, 9, 3), ([5, 17], [2], [30])
        chunks = [SeqChunk(seq=s, tokens=rng.integers(0, 500, n).tolist(), positions=list(range(n)), blocks=t,
                           sample=1) for s, n, t in zip((1, 2, 3), lengths, tables)]
        hidden = reference.step(Step(chunks=chunks, taps=config.taps)).hidden
        step, output = Step(chunks=chunks, taps=config.taps), StepOutput(hidden=hidden)
        committed = {1: 21, 2: 9, 3: 2}  # the third sequence keeps two rows (as a rewind leaves it)
        for speculator in (eager, mine):
            speculator.observe(step, output, committed)
        # three owners: one draft_block call of two and one of one
        requests = [DraftRequest(seq=s, tokens=chunks[i].tokens[:committed[s]] + [11 + i], blocks=tables[i],
                                 max_draft=n_draft - (i == 1)) for i, s in enumerate((1, 2, 3))]
        expected = eager.propose(requests)
        assert mine.propose(requests) == expected
        assert [len(expected[s]) for s in (1, 2, 3)] == [n_draft, n_draft - 1, n_draft]
        assert mine.kv_bytes_per_block() == eager.kv_bytes_per_block()
        # copy-on-write mirrors the store: a copy of sequence 1's first block drafts the same
        for speculator in (eager, mine):
            speculator.copy_blocks([(5, 20)])
        fork = [DraftRequest(seq=9, tokens=chunks[0].tokens[:10] + [4], blocks=[20], max_draft=n_draft)]
        assert mine.propose(fork) == eager.propose(fork)

"""The exported program's image path in eager torch (no export, fast): the
grid-as-inputs vision tower gives the eager tower's rows, and
``embed_text`` + ``forward_from_embeddings`` give the token forward's logits and K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from musegl_core.checkpoint.loader import load_checkpoint
from musegl_core.checkpoint.vision import load_vision
from musegl_core.tiny import TinyPreset, make_tiny
from musegl_cuda.model import MuseGlimmerDecoder
from musegl_cuda.vision import load_vision_encoder
from musegl_executorch.export.graph import EmbedText, FromEmbeddings, OffGraphDecoder
from musegl_executorch.export.lower import example_inputs
from musegl_executorch.export.vision import ExportVisionEncoder, grid_inputs

PRESET = TinyPreset(name="etv", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    intermediate_size=128, sliding_window=8, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("etv"), preset=PRESET, file_type="f32", mmproj=True)
    checkpoint = load_checkpoint(path)
    yield checkpoint, load_vision(path, path.parent / "mmproj.gguf", checkpoint.config.hidden_size)
    checkpoint.close()


@pytest.mark.parametrize("grid", [(2, 2), (4, 6), (8, 10)])  # one window, edge windows, several windows
def test_the_grid_as_inputs_tower_gives_the_eager_rows(tiny, grid):
    checkpoint, vision = tiny
    eager = load_vision_encoder(vision, checkpoint.config, torch.float32, torch.device("cpu"))
    pixels = torch.from_numpy(np.random.default_rng(0).standard_normal((grid[0] * grid[1], 588)).astype(np.float32))
    with torch.no_grad():
        theirs = eager(pixels, grid)
        mine = ExportVisionEncoder(eager)(pixels, *grid_inputs(vision.config, grid))
    assert mine.shape == theirs.shape == (grid[0] * grid[1] // 4, checkpoint.config.hidden_size)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_forward_from_embeddings_of_embed_text_rows_is_the_token_forward(tiny):
    checkpoint, _ = tiny
    config = checkpoint.config
    decoder = MuseGlimmerDecoder(config, torch.float32, torch.device("cpu"))
    for name, array in checkpoint.iter_weights():
        decoder.load_weight(name, torch.from_numpy(array))
    module = OffGraphDecoder.from_decoder(decoder, torch.float32)
    inputs = list(example_inputs(config, torch.float32, groups=1, rows=5, cached=3, windowed=2, cells=32, heads=2))
    inputs[0] = torch.tensor([[5, 900, 17, 3000, 42]])
    inputs[2], inputs[3] = torch.randn_like(inputs[2]), torch.randn_like(inputs[3])
    with torch.no_grad():
        theirs = module(*inputs)
        rows = EmbedText(module)(inputs[0][0])
        mine = FromEmbeddings(module)(rows[None], *inputs[1:])
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)
    # the wrappers hold the decoder's own tensors under its names: the data file stores them once
    names = dict(module.named_parameters()) | dict(module.named_buffers())
    for wrapper in (EmbedText(module), FromEmbeddings(module)):
        for name, tensor in list(wrapper.named_parameters()) + list(wrapper.named_buffers()):
            if name != "eps":
                assert names[name] is tensor

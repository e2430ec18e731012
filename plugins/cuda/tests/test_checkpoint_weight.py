"""``MuseGlimmerDecoder.checkpoint_weight`` gives back what ``load_weight`` took, in the checkpoint's terms."""

from __future__ import annotations

import pytest
import torch

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.hf_reader import CENTERED_NORMS
from musegl_cuda.model import MuseGlimmerDecoder


def tiny_config() -> TextConfig:
    layout = TextConfig.default_layout(2)
    return TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, sliding_window=8, sliding=layout, rope=layout)


def test_every_weight_comes_back_as_loaded_centered_norms_as_their_w():
    config = tiny_config()
    decoder = MuseGlimmerDecoder(config, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    loaded = {}
    for name in decoder.weight_names(config):
        shape = decoder.checkpoint_weight(name).shape
        loaded[name] = torch.randn(shape, generator=generator)
        decoder.load_weight(name, loaded[name])
    centered = 0
    for name, value in loaded.items():
        torch.testing.assert_close(decoder.checkpoint_weight(name), value)
        centered += name.split(".", 2)[-1] in CENTERED_NORMS
    assert centered == 4 * config.num_layers  # the norms kept as 1+w were among them


def test_stored_mode_has_no_matrix_tensors_to_give():
    config = tiny_config()
    decoder = MuseGlimmerDecoder(config, torch.float32, torch.device("cpu"), stored=True)
    with pytest.raises(ValueError, match="stored bytes"):
        decoder.checkpoint_weight("layers.0.mlp.down_proj.weight")
    assert decoder.checkpoint_weight("norm.weight").shape == (config.hidden_size,)

"""Shared fixtures for the core's and the plugins' tests: tiny random Muse
Glimmer checkpoints built with transformers (see musegl_core/testing/reference_models.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from musegl_core.testing.reference_models import TinyModel, build_tiny_model, tiny_tokenizer_data


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> TinyModel:
    """The reference model, saved as a Hugging Face directory (float32, one safetensors file)."""
    model = build_tiny_model()
    path = tmp_path_factory.mktemp("tiny_hf")
    model.save_pretrained(path)
    return TinyModel(model=model, path=path)


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf, tmp_path_factory) -> Path:
    """The GGUF (f32) twin of :func:`tiny_hf`, written with ``write_text_gguf``."""
    from musegl_core.checkpoint.gguf_writer import write_text_gguf
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(tiny_hf.path)
    path = tmp_path_factory.mktemp("tiny_gguf") / "model.gguf"
    write_text_gguf(path, checkpoint.config, dict(checkpoint.iter_weights()), tiny_tokenizer_data(),
                    file_type="f32", name="Tiny Muse Glimmer")
    return path

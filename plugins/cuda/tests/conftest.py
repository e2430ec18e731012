"""Fixtures shared by the torch-executor engine tests (a test module may define its own)."""

from __future__ import annotations

import pytest

from engine_run_support import demo_tokenizer
from musegl_core.checkpoint.loader import load_checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tiny_gguf):
    """The tiny GGUF checkpoint, loaded once per module."""
    return load_checkpoint(tiny_gguf)

"""Fixtures shared by the torch-executor engine tests (a test module may define its own). Imports
stay inside the fixtures: without torch, the modules that skip still collect."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    from engine_run_support import demo_tokenizer

    return demo_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tiny_gguf):
    """The tiny GGUF checkpoint, loaded once per module."""
    from musegl_core.checkpoint.loader import load_checkpoint

    return load_checkpoint(tiny_gguf)

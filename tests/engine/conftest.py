"""Fixtures shared by the engine tests (a test module may define its own)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    """The demo checkpoint's tokenizer (``musegl make-tiny``)."""
    from musegl_core.tiny import default_model_path
    from musegl_core.tokenizer import MuseTokenizer

    return MuseTokenizer.load(str(default_model_path()))

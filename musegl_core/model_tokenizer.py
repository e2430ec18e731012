"""The tokenizer a model path is served with.

A checkpoint's own tokenizer (:meth:`MuseTokenizer.load
<musegl_core.tokenizer.MuseTokenizer.load>`: GGUF metadata, a Hugging Face
directory, or a ``tokenizer.json`` beside the file), except for a bare
``config.json`` with no tokenizer and no weights beside it (served with
``--load-format dummy``), which gets the built-in demo tokenizer
(:func:`musegl_core.tiny.demo_tokenizer_for`).
"""

from __future__ import annotations

import os
from pathlib import Path

from musegl_core.tokenizer import MuseTokenizer, load_once


def load_tokenizer(model_path: str | os.PathLike[str]) -> MuseTokenizer:
    """The tokenizer ``musegl serve MODEL`` uses for ``model_path``, built once per
    process for a file unchanged on disk.

    :raises TokenizerError: the checkpoint has no usable tokenizer.
    """
    path = Path(model_path)
    return load_once("model", path, lambda: _load(path))


def _load(path: Path) -> MuseTokenizer:
    from musegl_core.tiny import demo_tokenizer_for

    demo = demo_tokenizer_for(path)
    return demo if demo is not None else MuseTokenizer.load(path)

"""Open a Muse Glimmer checkpoint, GGUF file or Hugging Face directory, as one :class:`Checkpoint`.

Both sources yield the same float32 numpy weights under the same names
(transformers names without ``model.language_model.``), so every executor
(torch, MLX) starts from identical weights and converts them tensor by tensor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator, Protocol

import attrs
import numpy as np

from musegl_core.checkpoint.config import TextConfig
from musegl_core.checkpoint.stored import StoredTensor
from musegl_core.checkpoint.tokenizer_data import GGUFTokenizerData

Progress = Callable[[int, int, str], None]


class WeightReader(Protocol):
    """What a format reader offers :class:`Checkpoint` (see ``gguf_reader``, ``hf_reader``)."""

    source: str
    config: TextConfig
    file_type: str
    name: str
    tensor_names: tuple[str, ...]
    tokenizer: GGUFTokenizerData | None

    def read(self, name: str) -> np.ndarray: ...

    # Optional: ``read_stored(name) -> StoredTensor`` (the weight in its stored dtype).
    # Readers without it are read in float32 by :meth:`Checkpoint.read_stored`.

    def close(self) -> None: ...


@attrs.define
class Checkpoint:
    """A text-decoder checkpoint, opened but not loaded.

    ``source`` is ``"gguf"`` or ``"hf"``; ``file_type`` the stored precision
    (``f32``, ``bf16``, ``q8_0`` ...); ``tokenizer`` the GGUF tokenizer
    metadata when the file has it (None for HF directories).
    :meth:`iter_weights` reads one tensor at a time and reports each to
    ``progress(done, total, name)``.
    """

    path: str
    config: TextConfig
    source: str
    file_type: str
    name: str
    tokenizer: GGUFTokenizerData | None
    reader: WeightReader = attrs.field(repr=False)
    progress: Progress | None = attrs.field(default=None, repr=False)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return self.reader.tensor_names

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensor_names)

    def read(self, name: str) -> np.ndarray:
        """One weight as float32, transformers layout."""
        return self.reader.read(name)

    def read_stored(self, name: str) -> StoredTensor:
        """One weight in its stored form, transformers layout, not upcast: ``f16``/``bf16``
        matrices in 2 bytes per value, GGUF quantized matrices as their raw blocks
        (see :mod:`musegl_core.checkpoint.stored`); 1-D weights as ``f32``. A reader
        without ``read_stored`` yields its float32 ``read``."""
        read_stored = getattr(self.reader, "read_stored", None)
        if read_stored is None:
            array = self.reader.read(name)
            return StoredTensor(name, "f32", tuple(array.shape), array)
        return read_stored(name)

    def iter_stored(self) -> Iterator[StoredTensor]:
        """:meth:`read_stored` for every text weight, one at a time, reporting progress."""
        total = self.num_tensors
        for done, name in enumerate(self.reader.tensor_names, start=1):
            stored = self.read_stored(name)
            if self.progress is not None:
                self.progress(done, total, name)
            yield stored

    def iter_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, float32 array)`` for every text weight, one at a time."""
        total = self.num_tensors
        for done, name in enumerate(self.reader.tensor_names, start=1):
            array = self.reader.read(name)
            if self.progress is not None:
                self.progress(done, total, name)
            yield name, array

    def close(self) -> None:
        self.reader.close()


def load_checkpoint(path: str | os.PathLike[str], progress: Progress | None = None) -> Checkpoint:
    """Open ``path``: a ``.gguf`` file (arch ``muse-glimmer``) or a directory with
    ``config.json`` and safetensors. Raises ``FileNotFoundError``/``ValueError``
    with a one-line reason for anything else."""
    from musegl_core.checkpoint.gguf_reader import GGUFTextReader
    from musegl_core.checkpoint.hf_reader import HFTextReader

    p = Path(path)
    if p.is_dir():
        reader: WeightReader = HFTextReader(p)
    elif p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"{p}: not a GGUF file and not a Hugging Face model directory")
        reader = GGUFTextReader(p)
    else:
        raise FileNotFoundError(f"{p}: no such checkpoint")
    return Checkpoint(path=str(p), config=reader.config, source=reader.source,
                      file_type=reader.file_type, name=reader.name, tokenizer=reader.tokenizer,
                      reader=reader, progress=progress)


def read_text_config(path: str | os.PathLike[str]) -> tuple[TextConfig, str]:
    """The text config and the name of the checkpoint at ``path`` without its weights:
    a Hugging Face directory's ``config.json`` (or that file named itself, with no
    safetensors needed), a GGUF's metadata. Raises ``FileNotFoundError``/``ValueError``
    with a one-line reason, like :func:`load_checkpoint`."""
    import json

    from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict

    p = Path(path)
    if p.is_dir() or p.name == "config.json":
        config_path = p / "config.json" if p.is_dir() else p
        if not config_path.is_file():
            raise FileNotFoundError(f"{p}: no config.json (not a Hugging Face model directory)")
        raw = json.loads(config_path.read_text())
        return text_config_from_dict(text_config_dict(raw, str(config_path))), config_path.parent.name
    checkpoint = load_checkpoint(p)
    checkpoint.close()
    return checkpoint.config, checkpoint.name

"""A checkpoint with a config and no weights (``--load-format dummy``): what the
executor, the tensor-parallel ranks and the GPU benchmarks build a random-weight
model from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from musegl_core.errors import ConfigError


@attrs.define
class ConfigOnly:
    """A checkpoint with a config and no weights (``--load-format dummy``)."""

    config: Any
    name: str

    def close(self) -> None:
        pass


def read_config_only(model: str) -> ConfigOnly:
    """The text config of a Hugging Face directory's ``config.json`` (or of a GGUF's
    metadata), without looking for weights."""
    from musegl_core.checkpoint.loader import read_text_config

    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"{path}: no config.json for --load-format dummy")
    config, name = read_text_config(path)
    return ConfigOnly(config, name)

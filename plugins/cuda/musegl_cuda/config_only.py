"""A checkpoint with a config and no weights (``--load-format dummy``): what the
executor, the tensor-parallel ranks and the GPU benchmarks build a random-weight
model from."""

from __future__ import annotations

import json
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
    from musegl_core.checkpoint.hf_reader import text_config_dict, text_config_from_dict

    path = Path(model)
    if path.is_dir() or path.name == "config.json":
        config_path = path / "config.json" if path.is_dir() else path
        if not config_path.is_file():
            raise ConfigError(f"{path}: no config.json for --load-format dummy")
        raw = json.loads(config_path.read_text())
        config = text_config_from_dict(text_config_dict(raw, str(config_path)))
        return ConfigOnly(config, config_path.parent.name)
    from musegl_core.checkpoint.loader import load_checkpoint

    checkpoint = load_checkpoint(model)
    checkpoint.close()
    return ConfigOnly(checkpoint.config, checkpoint.name)

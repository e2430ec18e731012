"""Check, before serving, that a checkpoint can be served: one clear line if not.

``musegl serve`` runs :func:`check_servable` before it binds a port or starts
a worker, so a wrong path, garbage bytes, a GGUF without a tokenizer or a
directory without ``config.json`` end the command with exit status 2 and one
line, instead of a worker that crashes on every start. It reads the header,
the tensor index and the tokenizer, not the weights.
"""

from __future__ import annotations

import os

from musegl_core.errors import ConfigError


def one_line(exc: BaseException) -> str:
    """An exception as one line of text (its first line, or its type)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_servable(path: str | os.PathLike[str]) -> None:
    """Raise :class:`ConfigError` unless ``path`` opens as a Muse Glimmer checkpoint
    with a tokenizer."""
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.model_tokenizer import load_tokenizer

    try:
        checkpoint = load_checkpoint(path)
        try:
            if not checkpoint.tensor_names:
                raise ValueError("the checkpoint holds no tensors")
        finally:
            checkpoint.close()
        load_tokenizer(path)
    except Exception as exc:  # the readers raise whatever malformed bytes provoke
        raise ConfigError(f"cannot serve {os.fspath(path)!r}: {one_line(exc)}") from None

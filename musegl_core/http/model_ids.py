"""The ids the served model answers to.

* The **served id** is the first ``--served-model-name``, or else a slug of
  the checkpoint's name: the GGUF ``general.name`` (falling back to the file
  name without ``.gguf``) or the Hugging Face directory's name. A slug keeps
  ASCII letters, digits, ``.``, ``_`` and ``-``; every other run of
  characters (spaces included) becomes one ``-``.
* Further ``--served-model-name`` values are **aliases**: ``/v1/models``
  lists them after the served id.
* ``musegl`` is always accepted by ``GET /v1/models/{id}``, whatever else is
  configured, so clients written against the documentation work everywhere.

The ``model`` field of a generation request stays lenient: any value is
accepted and responses carry the served id.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

ALWAYS_ACCEPTED = "musegl"
_NOT_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def slug(name: str) -> str:
    """``"Muse Glimmer 30B (Q8)"`` → ``"Muse-Glimmer-30B-Q8"``; empty → ``musegl``."""
    return _NOT_SLUG.sub("-", name).strip("-") or ALWAYS_ACCEPTED


def checkpoint_name(model: str | None) -> str:
    """The checkpoint's own name (cheap: reads only GGUF metadata)."""
    if model is None:
        return ALWAYS_ACCEPTED
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    try:
        from musegl_core.checkpoint.gguf_tokenizer import read_gguf_metadata

        name = read_gguf_metadata(path, prefixes=("general.name",)).get("general.name")
    except Exception:  # unreadable here: the worker reports the real problem
        name = None
    return str(name) if name else path.name.removesuffix(".gguf")


@attrs.frozen
class ModelIds:
    served: str
    aliases: tuple[str, ...] = ()

    @property
    def listed(self) -> tuple[str, ...]:
        """``/v1/models``: the served id, then the aliases."""
        return tuple(dict.fromkeys((self.served, *self.aliases)))

    def accepts(self, model_id: str) -> bool:
        return model_id in self.listed or model_id == ALWAYS_ACCEPTED

    @classmethod
    def resolve(cls, served_model_name: str | None, aliases: tuple[str, ...], model: str | None) -> "ModelIds":
        served = served_model_name or slug(checkpoint_name(model))
        return cls(served, tuple(a for a in aliases if a != served))

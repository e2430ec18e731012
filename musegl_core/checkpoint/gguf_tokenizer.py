"""The tokenizer metadata of a GGUF file (``tokenizer.ggml.*``), read without building a tokenizer.

:class:`~musegl_core.tokenizer.MuseTokenizer` builds its BPE from what
:func:`read_gguf_tokenizer_data` returns; :func:`read_gguf_metadata` also
serves anything else that wants a few metadata values cheaply (the model's
``general.name``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from musegl_core.checkpoint.tokenizer_data import NORMAL, GGUFTokenizerData, TokenizerError

if TYPE_CHECKING:
    from gguf import GGUFReader

__all__ = ["read_gguf_metadata", "read_gguf_tokenizer_data"]


def read_gguf_metadata(path: str | Path, prefixes: Sequence[str] = ("tokenizer.",)) -> dict[str, Any]:
    """The GGUF metadata values whose keys start with one of ``prefixes``
    (decoded with the fast parser of :mod:`musegl_core.checkpoint.gguf_file`)."""
    from musegl_core.checkpoint.gguf_file import GGUFFile, GGUFFormatError

    try:
        gguf_file = GGUFFile(path, wanted=prefixes, tensors=False)
    except GGUFFormatError as exc:
        raise TokenizerError(str(exc)) from None
    gguf_file.close()
    return {k: v for k, v in gguf_file.fields.items() if k.startswith(tuple(prefixes))}


def _tokenizer_data(value: Callable[[str, Any], Any]) -> GGUFTokenizerData | None:
    """:class:`GGUFTokenizerData` from a ``value(key, default)`` accessor of GGUF metadata."""
    tokens = value("tokenizer.ggml.tokens", None)
    if tokens is None:
        return None
    model = value("tokenizer.ggml.model", "gpt2")
    if model != "gpt2":
        raise TokenizerError(f"unsupported GGUF tokenizer model {model!r} (Muse Glimmer uses byte-level BPE, 'gpt2')")
    token_types = value("tokenizer.ggml.token_type", None)
    if token_types is None:
        token_types = [NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise TokenizerError("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")

    def optional_id(key: str) -> int | None:
        raw = value(key, None)
        return None if raw is None else int(raw)

    bos, eos = optional_id("tokenizer.ggml.bos_token_id"), optional_id("tokenizer.ggml.eos_token_id")
    return GGUFTokenizerData(
        tokens=tuple(tokens),
        token_types=tuple(int(t) for t in token_types),
        merges=tuple(value("tokenizer.ggml.merges", ())),
        bos_token_id=-1 if bos is None else bos,
        eos_token_id=-1 if eos is None else eos,
        eot_token_id=optional_id("tokenizer.ggml.eot_token_id"),
        padding_token_id=optional_id("tokenizer.ggml.padding_token_id"),
        mask_token_id=optional_id("tokenizer.ggml.mask_token_id"),
        model=model,
        pre=value("tokenizer.ggml.pre", "default"),
        add_bos_token=bool(value("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(value("tokenizer.ggml.add_eos_token", False)),
        chat_template=value("tokenizer.chat_template", None),
    )


def read_gguf_tokenizer_data(source: str | Path | GGUFReader) -> GGUFTokenizerData | None:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file (a path or an open reader), or None.

    A missing BOS/EOS id is reported as ``-1`` (then resolved by string).
    """
    if isinstance(source, (str, Path)):
        values = read_gguf_metadata(source, ("tokenizer.",))
        return _tokenizer_data(values.get)
    fields = source.fields

    def value(key: str, default: Any) -> Any:
        field = fields.get(key)
        return default if field is None else field.contents()

    return _tokenizer_data(value)

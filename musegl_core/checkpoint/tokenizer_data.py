"""The tokenizer as a GGUF file stores it."""

from __future__ import annotations

import attrs


class TokenizerError(ValueError):
    """A tokenizer that cannot be built or lacks a required token."""


# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@attrs.frozen
class GGUFTokenizerData:
    """``tokenizer.ggml.*`` metadata: everything needed to rebuild the tokenizer.

    ``tokens[i]`` is the string of id ``i`` (byte-level BPE alphabet, as in
    tokenizer.json); ``token_types[i]`` one of the constants above; ``merges``
    the BPE merges as ``"a b"`` strings.
    """

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_token_id: int
    eos_token_id: int
    eot_token_id: int | None = None
    padding_token_id: int | None = None
    mask_token_id: int | None = None
    model: str = "gpt2"
    pre: str = "llama4"
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

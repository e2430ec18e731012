"""Incremental detokenization: generated ids → text, one token at a time.

Byte-level BPE splits a multi-byte UTF-8 character across tokens freely (an
emoji can take four tokens of one byte each). :class:`IncrementalDetokenizer`
therefore keeps the bytes of the generation so far and hands out only text
whose characters are complete; the bytes of a character still being spelt
wait for the tokens that finish it. The concatenation of every ``push`` and
the final ``flush`` equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

import codecs
import weakref
from typing import Protocol

from musegl_core.chat.channels import CONTROL_TOKENS


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer (``MuseTokenizer`` provides it)."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for (special tokens: their UTF-8 string)."""


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text.

    Special tokens come out as their strings (``<|eom|>``), except the ids in
    ``hidden`` (a request's ``skip_special_tokens``); ids without a token
    contribute nothing. Invalid UTF-8 becomes U+FFFD as soon as it is known to be
    invalid; an incomplete character at the end is released by :meth:`flush`.
    """

    def __init__(self, tokenizer: TokenBytes, hidden: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._hidden = hidden  # ids whose text is left out (skip_special_tokens)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._finished = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completed (possibly empty)."""
        if self._finished:
            raise RuntimeError("push() after flush()")
        if token_id in self._hidden:
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(int(token_id)), final=False)

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they begin a character not yet complete."""
        return self._decoder.getstate()[0]

    def flush(self) -> str:
        """End of generation: release held-back bytes (as U+FFFD) and stop."""
        if self._finished:
            return ""
        self._finished = True
        return self._decoder.decode(b"", final=True)


_SPECIALS: "weakref.WeakKeyDictionary[object, tuple[frozenset[int], frozenset[int]]]" = weakref.WeakKeyDictionary()


def hidden_ids(tokenizer: TokenBytes, special_tokens: str) -> frozenset[int]:
    """The ids a request's detokenizer leaves out, for its ``special_tokens``
    (:class:`~musegl_core.engine.request.GenerateRequest`): none for ``all``;
    every special id but the output grammar's control tokens for ``control``;
    every special id for ``none``. A tokenizer without ``special_ids`` hides nothing."""
    if special_tokens == "all" or not hasattr(tokenizer, "special_ids"):
        return frozenset()
    try:
        known = _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        every = frozenset(tokenizer.special_ids())
        control = frozenset(i for i in every if tokenizer.token_bytes(i).decode("utf-8", "replace") in CONTROL_TOKENS)
        known = (every - control, every)
        try:
            _SPECIALS[tokenizer] = known
        except TypeError:  # not weakly referenceable: computed again next time
            pass
    return known[0] if special_tokens == "control" else known[1]

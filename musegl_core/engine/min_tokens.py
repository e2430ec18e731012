"""``min_tokens`` (vLLM's field): the ids that would end generation are held off.

Until a sequence has generated ``min_tokens`` ids, :class:`MinTokensProcessor`
masks the end-of-generation ids (unless ``ignore_eos``) and the request's
``stop_token_ids``, so the earliest they can be drawn is as id
``min_tokens + 1``; the engine also applies stop strings only to the text of
ids after the first ``min_tokens`` (:meth:`musegl_core.engine.engine.Engine._on_token`),
as vLLM does. It is an ordinary logits processor: its mask is ANDed with a
grammar's, and once it is idle the request's steps may be launched ahead
again (``idle``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


class MinTokensProcessor:
    """Masks ``blocked`` ids while fewer than ``min_tokens`` ids were generated."""

    def __init__(self, min_tokens: int, blocked: Iterable[int], vocab_size: int):
        self.min_tokens = min_tokens
        words = -(-vocab_size // 32)
        allowed = np.full(words, 0xFFFFFFFF, dtype=np.uint32)
        for token in set(blocked):
            if 0 <= token < words * 32:
                allowed[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
        allowed.flags.writeable = False
        self.allowed = allowed

    def mask(self, generated: Sequence[int]) -> np.ndarray | None:
        return None if self.idle(len(generated)) else self.allowed

    def idle(self, generated: int) -> bool:
        """No mask any more once ``generated`` ids exist (nothing is computed from their values)."""
        return generated >= self.min_tokens

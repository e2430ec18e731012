"""The front's context preflight.

Before a text prompt reaches the worker, the front counts its tokens with the
served tokenizer (loaded once at start-up, see
:mod:`musegl_core.http.front_tokenizer`) exactly as the worker will: the
rendered segments through :meth:`~musegl_core.tokenizer.MuseTokenizer.encode_segments`,
numeric BOS included. A prompt that does not fit the context budget after the
completion reservation (``max_tokens``, or one token when absent) is refused
with the worker's ``context_length_exceeded`` error, marked ``source:
"front"``, so it never takes an admission slot.

Image prompts skip the preflight: only the worker knows how many positions an
image expands to, so only the worker reports their count (``source:
"worker"``). Without a tokenizer (no model path, or it could not be read) the
preflight steps aside and the worker's own check, which always runs, reports.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING


from musegl_core.engine.engine import context_error

if TYPE_CHECKING:
    from musegl_core.http.completions import ChatPlan
    from musegl_core.tokenizer import MuseTokenizer

#: ``metadata.source`` of an overflow found by the front.
SOURCE = "front"


def completion_reservation(max_tokens: int | None) -> int:
    """The positions kept free for the completion: ``max_tokens``, or one token
    when the request gives no limit (the seed's rule, shared with the worker)."""
    return max_tokens or 1


async def check_context(plan: ChatPlan, tokenizer: MuseTokenizer | None, max_context: int) -> None:
    """Raise the 400 ``context_length_exceeded`` error when ``plan``'s text prompt
    cannot fit ``max_context`` with its completion reservation.

    Tokenizing runs in a thread, so a long history does not stall the event
    loop. Does nothing for image prompts or without a tokenizer.
    """
    if plan.image_count or tokenizer is None:
        return
    generate = plan.generate
    ids = await asyncio.to_thread(tokenizer.encode_segments, generate.prompt, add_bos=generate.add_bos)
    reservation = completion_reservation(generate.max_tokens)
    if len(ids) + reservation > max_context:
        raise context_error(len(ids), reservation, max_context, source=SOURCE)

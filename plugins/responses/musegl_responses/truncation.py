"""``truncation: "auto"``: drop the oldest turns until the prompt fits the context.

The conversation's leading system and developer messages (``instructions``
included) always stay, and so does its last turn (from the last user message
on). In between, whole turns are dropped from the start — a turn is a user
message and everything up to the next one (the assistant's reasoning, calls
and their outputs), so no call loses its output or an output its call — as
few as make the rendered prompt, counted with the served tokenizer, leave the
completion's reservation free (``max_output_tokens``, else 1 position). When
even the last turn alone does not fit, nothing is dropped and the request
fails as with ``disabled`` (``context_length_exceeded``). Images cannot be
counted in the front, so a conversation with an image is not truncated.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import attrs

from musegl_core.errors import bad_request
from musegl_core.service.conversation import Conversation
from musegl_core.tokenizer import TokenizationError


def turn_starts(conversation: Conversation) -> tuple[int, list[int]]:
    """The index after the leading system messages, and where each later user turn starts."""
    messages = conversation.messages
    head = 0
    while head < len(messages) and messages[head].role in ("system", "developer"):
        head += 1
    starts = [i for i in range(head, len(messages)) if messages[i].role == "user"]
    if not starts or starts[0] != head:
        starts = [head, *starts]
    return head, starts


def without_turns(conversation: Conversation, head: int, start: int) -> Conversation:
    messages = list(conversation.messages)
    return attrs.evolve(conversation, messages=messages[:head] + messages[start:])


async def fit(conversation: Conversation, *, prepare: Callable[[Conversation], Any], tokenizer: Any,
              max_context: int) -> Conversation:
    """The conversation with as few leading turns dropped as make it fit (see the module docstring)."""
    if tokenizer is None:
        return conversation  # the worker still refuses a prompt that does not fit

    async def fits(candidate: Conversation) -> bool | None:
        plan = prepare(candidate)
        if plan.image_count:
            return None
        try:
            ids = await asyncio.to_thread(tokenizer.encode_segments, plan.generate.prompt, add_bos=plan.generate.add_bos)
        except TokenizationError as exc:
            raise bad_request(f"could not tokenize the prompt: {exc}", param="input") from None
        return len(ids) + (plan.generate.max_tokens or 1) <= max_context

    whole = await fits(conversation)
    if whole is None or whole:
        return conversation
    head, starts = turn_starts(conversation)
    if len(starts) < 2:
        return conversation
    low, high = 1, len(starts) - 1  # drop starts[:k]: keep from starts[k]
    if not await fits(without_turns(conversation, head, starts[high])):
        return conversation
    while low < high:
        middle = (low + high) // 2
        if await fits(without_turns(conversation, head, starts[middle])):
            high = middle
        else:
            low = middle + 1
    return without_turns(conversation, head, starts[low])

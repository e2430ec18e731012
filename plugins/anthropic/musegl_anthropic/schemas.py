"""The Messages API wire shapes, as attrs classes.

Requests are structured with the core's strict converter
(:func:`musegl_core.http.schemas.structure_body`): a wrong type is a 400 that
names the field, and a top-level key this server does not know is a 400
naming it (as Anthropic's own API answers), never silently dropped. Fields
that change nothing on a single local model (``context_management``,
``service_tier``, ``speed``, ``inference_geo``) are declared and accepted;
``cache_control`` asks for a retention (docs/sessions.md "Retention"). The nested shapes (``messages``, ``system``,
``tools``, ``tool_choice``, ``thinking``, ``output_config``) stay raw JSON
here and are checked by :mod:`musegl_anthropic.request`, whose errors name
the exact path (``messages[2].content[0].source.type``).

Responses are written with the same converter; a response object's ``type``
is its class's (:class:`Typed`) and comes first in its JSON.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from musegl_core.http.schemas import JSON_SCHEMA, cache_salt_field, closed, omittable

_BLOCK = {"type": "object", "properties": {"type": {"type": "string"}}, "required": ["type"]}
MESSAGES_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "role": {"enum": ["user", "assistant", "system"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]},
        },
        "required": ["role", "content"],
    },
}
SYSTEM_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _BLOCK}]}


def raw(schema: dict | None = None) -> Any:
    """A field kept as raw JSON (checked by :mod:`musegl_anthropic.request`), documented by ``schema``."""
    return attrs.field(default=None, metadata={JSON_SCHEMA: schema} if schema else {})


@closed
@attrs.frozen
class MessagesRequest:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` (which ignores the
    generation fields and does not need ``max_tokens``)."""

    model: str | None = None
    messages: Any = raw(MESSAGES_SCHEMA)
    max_tokens: int | None = None
    system: Any = raw(SYSTEM_SCHEMA)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = raw({"type": "object"})
    thinking: Any = raw({"type": "object"})
    output_config: Any = raw({"type": "object"})
    output_format: Any = raw({"type": "object"})  # the structured-outputs beta's spelling of output_config.format
    metadata: Any = raw({"type": "object"})
    #: musegl's (vLLM's) prefix-cache isolation: Anthropic's API has no field of its own for it
    cache_salt: str | None = cache_salt_field()
    #: ``{"type": "ephemeral", "ttl": "5m" | "1h"}``: how long the conversation's KV is kept (request.py,
    #: docs/sessions.md "Retention"); here and on any block or tool
    cache_control: Any = raw({"type": "object"})
    # Accepted; they change nothing here (one local model, no billing tiers, no server-side editing).
    context_management: Any = raw({"type": "object"})
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    # Claude Code's server-side classifier of tool uses: answered "unsupported" (request.py)
    safeguards: Any = raw({"type": "array"})
    # Refused when set: musegl cannot honour them (checked in request.py).
    container: Any = raw()
    mcp_servers: Any = raw()
    diagnostics: Any = raw()


# -- responses ----------------------------------------------------------------------------
@attrs.frozen
class Typed:
    """A response object named by its ``type``, which its class fixes
    (``class TextBlock(Typed, type="text")``); the field comes first, so the
    JSON writes it first, as Anthropic's API does."""

    TYPE: ClassVar[str] = ""
    type: str = attrs.field(kw_only=True, default=attrs.Factory(lambda self: self.TYPE, takes_self=True))

    def __init_subclass__(cls, type: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = type or cls.TYPE  # attrs rebuilds a slotted class without the keyword


@attrs.frozen
class TextBlock(Typed, type="text"):
    text: str


@attrs.frozen
class ThinkingBlock(Typed, type="thinking"):
    """A reasoning block; ``signature`` seals the generated ids (empty when they
    could not be sealed: the block then goes back as plain text)."""

    thinking: str
    signature: str


@attrs.frozen
class ToolUseBlock(Typed, type="tool_use"):
    id: str
    name: str
    input: Any


@attrs.frozen
class Usage:
    """Anthropic's usage: ``input_tokens`` excludes the cached positions
    (``cache_read_input_tokens``); the prompt is their sum (musegl writes no
    separate cache: ``cache_creation_input_tokens`` is 0)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


@attrs.frozen
class Message(Typed, type="message"):
    id: str
    model: str
    content: list[Any]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"
    #: the answer to the request's ``safeguards``: ``unsupported`` for each (left out when none was asked)
    safeguard_results: list[Any] | None = omittable()


@attrs.frozen
class TokenCount:
    input_tokens: int


# -- stream events ---------------------------------------------------------------------------
@attrs.frozen
class MessageStart(Typed, type="message_start"):
    message: Message


@attrs.frozen
class Ping(Typed, type="ping"):
    """Sent while a stream is idle (keepalive)."""


@attrs.frozen
class BlockEvent(Typed):
    """An event of the content block at ``index`` (its start, a delta, its stop)."""

    index: int


@attrs.frozen
class ContentBlockStart(BlockEvent, type="content_block_start"):
    content_block: Any


@attrs.frozen
class ContentBlockDelta(BlockEvent, type="content_block_delta"):
    delta: Any  # a TextDelta, ThinkingDelta, SignatureDelta or InputJsonDelta


@attrs.frozen
class ContentBlockStop(BlockEvent, type="content_block_stop"):
    """The block at ``index`` is complete."""


@attrs.frozen
class TextDelta(Typed, type="text_delta"):
    text: str


@attrs.frozen
class ThinkingDelta(Typed, type="thinking_delta"):
    thinking: str


@attrs.frozen
class SignatureDelta(Typed, type="signature_delta"):
    signature: str


@attrs.frozen
class InputJsonDelta(Typed, type="input_json_delta"):
    partial_json: str


@attrs.frozen
class StopDelta:
    stop_reason: str | None
    stop_sequence: str | None
    safeguard_results: list[Any] | None = omittable()


@attrs.frozen
class MessageDelta(Typed, type="message_delta"):
    delta: StopDelta
    usage: Usage  # cumulative


@attrs.frozen
class MessageStop(Typed, type="message_stop"):
    """The last event of a stream."""

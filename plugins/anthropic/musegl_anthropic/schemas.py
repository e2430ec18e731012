"""The Messages API wire shapes, as attrs classes.

Requests are structured with the core's strict converter
(:func:`musegl_core.http.schemas.structure_body`): a wrong type is a 400 that
names the field, and a top-level key this server does not know is a 400
naming it (as Anthropic's own API answers), never silently dropped. Fields
that change nothing on a single local model (``cache_control``,
``context_management``, ``service_tier``, ``speed``, ``inference_geo``) are
declared and accepted. The nested shapes (``messages``, ``system``,
``tools``, ``tool_choice``, ``thinking``, ``output_config``) stay raw JSON
here and are checked by :mod:`musegl_anthropic.request`, whose errors name
the exact path (``messages[2].content[0].source.type``).

Responses are written with the same converter; ``omittable`` fields vanish
while ``None``.
"""

from __future__ import annotations

from typing import Any

import attrs

from musegl_core.http.schemas import JSON_SCHEMA, closed

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
    # Accepted; they change nothing here (one local model, no billing tiers, no server-side editing).
    cache_control: Any = raw({"type": "object"})
    context_management: Any = raw({"type": "object"})
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    # Refused when set: musegl cannot honour them (checked in request.py).
    container: Any = raw()
    mcp_servers: Any = raw()
    diagnostics: Any = raw()


# -- responses ----------------------------------------------------------------------------
@attrs.frozen
class TextBlock:
    text: str
    type: str = "text"


@attrs.frozen
class ThinkingBlock:
    """A reasoning block; ``signature`` seals the generated ids (empty when they
    could not be sealed: the block then goes back as plain text)."""

    thinking: str
    signature: str
    type: str = "thinking"


@attrs.frozen
class ToolUseBlock:
    id: str
    name: str
    input: Any
    type: str = "tool_use"


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
class Message:
    id: str
    model: str
    content: list[Any]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    type: str = "message"
    role: str = "assistant"


@attrs.frozen
class TokenCount:
    input_tokens: int


# -- stream events ---------------------------------------------------------------------------
@attrs.frozen
class MessageStart:
    message: Message
    type: str = "message_start"


@attrs.frozen
class Ping:
    type: str = "ping"


@attrs.frozen
class ContentBlockStart:
    index: int
    content_block: Any
    type: str = "content_block_start"


@attrs.frozen
class TextDelta:
    text: str
    type: str = "text_delta"


@attrs.frozen
class ThinkingDelta:
    thinking: str
    type: str = "thinking_delta"


@attrs.frozen
class SignatureDelta:
    signature: str
    type: str = "signature_delta"


@attrs.frozen
class InputJsonDelta:
    partial_json: str
    type: str = "input_json_delta"


@attrs.frozen
class ContentBlockDelta:
    index: int
    delta: Any
    type: str = "content_block_delta"


@attrs.frozen
class ContentBlockStop:
    index: int
    type: str = "content_block_stop"


@attrs.frozen
class StopDelta:
    stop_reason: str | None
    stop_sequence: str | None


@attrs.frozen
class MessageDelta:
    delta: StopDelta
    usage: Usage  # cumulative
    type: str = "message_delta"


@attrs.frozen
class MessageStop:
    type: str = "message_stop"

"""Chat messages and tool declarations as the template sees them.

These are the validated, normalised forms of the OpenAI request fields
(``messages``, ``tools``). :func:`parse_messages` and :func:`parse_tools`
turn raw JSON values into them and raise :class:`~musegl_core.errors.ApiError`
(400 ``invalid_request_error``) naming the offending field.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

ROLES = ("system", "developer", "user", "assistant", "tool")


@attrs.frozen
class TextPart:
    text: str


@attrs.frozen
class ImagePart:
    """An inline image (``data:image/png;base64,...`` or JPEG). ``data`` holds
    the decoded bytes once validated; the template renders one ``<|patch|>``."""

    url: str
    media_type: str = ""
    data: bytes = b""


ContentPart = Union[TextPart, ImagePart]
Content = Union[str, list, None]  # str | list[ContentPart] | None


@attrs.frozen
class FunctionCall:
    name: str
    arguments: dict[str, Any]  # parsed from the JSON string; key order preserved


@attrs.frozen
class ToolCall:
    id: str | None
    function: FunctionCall
    type: str = "function"


@attrs.frozen
class Message:
    role: str
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None
    # Not OpenAI fields; used internally by the template (chat-format.md 2.9).
    recipient: str | None = None
    end_turn: bool | None = None


@attrs.frozen
class ToolDef:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

"""Chat messages and tool declarations as the template sees them.

These are the validated, normalised forms of the OpenAI request fields
(``messages``, ``tools``). :func:`parse_messages` and :func:`parse_tools`
turn raw JSON values into them and raise :class:`~musegl_core.errors.ApiError`
(400 ``invalid_request_error``) naming the offending field in ``param``
(``messages[2].content[0].text``).

Normalisation done here:

* ``tool_calls[].function.arguments`` arrive as a JSON string and are parsed
  into a mapping (key order kept; the empty string is ``{}``);
* ``reasoning`` (OpenRouter's name) is accepted for ``reasoning_content``;
* ``image_url`` parts must be inline PNG/JPEG data URLs; their bytes are
  decoded, and at most one image may appear in the whole history; ``detail``
  may be ``auto``, ``low`` or ``high`` (the worker maps it to a patch budget,
  :func:`musegl_core.vision.preprocess.detail_patches`);
* tools may be given in OpenAI form (``{"type": "function", "function":
  {...}}``) or bare; ``null`` and ``[]`` mean no tools.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any, Union

import attrs

from musegl_core.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")

#: Data-URL prefixes accepted for images, with their media types.
IMAGE_URL_PREFIXES = {
    "data:image/png;base64,": "image/png",
    "data:image/jpeg;base64,": "image/jpeg",
}
#: OpenAI's ``image_url.detail`` values (None: absent, the same as ``auto``)
IMAGE_DETAILS = ("auto", "low", "high")
_INLINE_FORMS = "data:image/png;base64,... or data:image/jpeg;base64,..."


@attrs.frozen
class TextPart:
    """A text content part; the client's text, rendered verbatim."""

    text: str


@attrs.frozen
class ImagePart:
    """An inline image (``data:image/png;base64,...`` or JPEG). ``data`` holds
    the decoded bytes once validated; ``detail`` is OpenAI's ``auto``/``low``/``high``
    (None when absent); the template renders one ``<|patch|>``."""

    url: str = attrs.field(repr=lambda url: f"{url[:32]}...({len(url)} chars)")
    media_type: str = ""
    data: bytes = attrs.field(default=b"", repr=lambda data: f"<{len(data)} bytes>")
    detail: str | None = None


ContentPart = Union[TextPart, ImagePart]
#: ``str``, a sequence of :data:`ContentPart` (a tuple once parsed), or ``None``.
Content = Union[str, Sequence[ContentPart], None]


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
    """One chat message. ``content`` is a string, a tuple of parts or ``None``."""

    role: str
    content: Content = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning_content: str | None = None
    # Not OpenAI fields; used internally by the template.
    recipient: str | None = None
    end_turn: bool | None = None
    #: The exact generated ids of ``reasoning_content`` (a verified
    #: :class:`~musegl_core.service.reasoning_seal.SealedReasoning`: ``ids``,
    #: ``opens_turn``): the template writes them instead of rendering the text.
    reasoning_ids: Any = None


@attrs.frozen
class ToolDef:
    """A declared function tool. ``parameters`` is the JSON Schema as sent."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


# -- parsing ------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _expect(value: Any, kinds: tuple[type, ...], what: str, param: str) -> Any:
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"'{param}' must be {what}, got {_type_name(value)}.", param=param)
    return value


def _optional_str(obj: dict, key: str, param: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    return _expect(value, (str,), "a string", f"{param}.{key}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_arguments(raw: Any, param: str) -> dict[str, Any]:
    """Parse tool-call ``arguments`` (a JSON string, or already a mapping) into
    a ``dict`` with the client's key order. The empty string counts as ``{}``; anything that is not a JSON object is a 400."""
    if isinstance(raw, dict):
        return raw
    _expect(raw, (str,), "a JSON string", param)
    if raw.strip() == "":
        return {}
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError as exc:
        raise bad_request(f"'{param}' is not valid JSON: {exc}.", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must encode a JSON object, got {_type_name(value)}.", param=param)
    return value


def _parse_image(part: dict, param: str) -> ImagePart:
    image_url = part.get("image_url")
    if not isinstance(image_url, dict):
        raise bad_request(f"'{param}.image_url' must be an object with a 'url'.", param=f"{param}.image_url")
    detail = image_url.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad_request(
            f"Image 'detail' must be 'auto', 'low' or 'high', got {json.dumps(detail)[:40]}.",
            code="invalid_image",
            param=f"{param}.image_url.detail",
        )
    url_param = f"{param}.image_url.url"
    url = image_url.get("url")
    if not isinstance(url, str):
        raise bad_request(f"'{url_param}' must be a string.", code="invalid_image", param=url_param)
    for prefix, media_type in IMAGE_URL_PREFIXES.items():
        if url[: len(prefix)].lower() == prefix:  # media types are case-insensitive
            break
    else:
        raise bad_request(_unsupported_url(url), code="invalid_image", param=url_param)
    try:
        data = base64.b64decode(url[len(prefix) :], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("The image data is not valid base64.", code="invalid_image", param=url_param) from None
    if not data:
        raise bad_request("The image data is empty.", code="invalid_image", param=url_param)
    return ImagePart(url=url, media_type=media_type, data=data, detail=detail)


def _unsupported_url(url: str) -> str:
    """Why an image URL is refused: its data URL's format, its encoding, or that it is not inline."""
    if url[:5].lower() == "data:":
        header = url[5:].split(",", 1)[0]
        media_type, *params = header.split(";")
        media_type = media_type.strip().lower() or "text/plain"
        if media_type in ("image/png", "image/jpeg"):
            if "base64" not in (p.strip().lower() for p in params):
                return f"The image data URL must be base64-encoded: {_INLINE_FORMS}."
            return f"Write the image data URL exactly as {_INLINE_FORMS}."
        return (f"Image format {media_type[:60]} is not supported: send the image as PNG or JPEG, "
                f"{_INLINE_FORMS}.")
    return f"Images must be inline data URLs of the form {_INLINE_FORMS} (remote URLs and file paths are not fetched)."


def _parse_content(raw: Any, param: str) -> Content:
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise bad_request(f"'{param}' must be a string, null or an array of content parts.", param=param)
    parts: list[ContentPart] = []
    for index, part in enumerate(raw):
        part_param = f"{param}[{index}]"
        _expect(part, (dict,), "an object", part_param)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            _expect(text, (str,), "a string", f"{part_param}.text")
            parts.append(TextPart(text))
        elif kind == "image_url":
            parts.append(_parse_image(part, part_param))
        else:
            raise bad_request(
                f"Unsupported content part type {kind!r} in '{part_param}'; "
                "only 'text' and 'image_url' parts are accepted.",
                param=f"{part_param}.type",
            )
    return tuple(parts)


def _parse_tool_calls(raw: Any, param: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    _expect(raw, (list,), "an array", param)
    calls = []
    for index, call in enumerate(raw):
        call_param = f"{param}[{index}]"
        _expect(call, (dict,), "an object", call_param)
        kind = call.get("type", "function")
        if kind not in ("function", None):
            raise bad_request(f"'{call_param}.type' must be 'function'.", param=f"{call_param}.type")
        call_id = _optional_str(call, "id", call_param)
        function = call.get("function")
        _expect(function, (dict,), "an object", f"{call_param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(
                f"'{call_param}.function.name' must be a non-empty string.", param=f"{call_param}.function.name"
            )
        arguments = parse_json_arguments(function.get("arguments", ""), f"{call_param}.function.arguments")
        calls.append(ToolCall(id=call_id, function=FunctionCall(name, arguments)))
    return tuple(calls)


def _parse_message(raw: Any, param: str) -> Message:
    _expect(raw, (dict,), "an object", param)
    role = raw.get("role")
    if role not in ROLES:
        raise bad_request(
            f"'{param}.role' must be one of {', '.join(ROLES)}; got {role!r}.", param=f"{param}.role"
        )
    if "content" not in raw and role != "assistant":
        raise bad_request(f"'{param}.content' is required for {role} messages.", param=f"{param}.content")
    content = _parse_content(raw.get("content"), f"{param}.content")
    if content is None and role != "assistant":
        raise bad_request(f"'{param}.content' must not be null for {role} messages.", param=f"{param}.content")
    name = _optional_str(raw, "name", param)
    tool_call_id = _optional_str(raw, "tool_call_id", param) if role == "tool" else None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning = None
    if role == "assistant":
        tool_calls = _parse_tool_calls(raw.get("tool_calls"), f"{param}.tool_calls")
        reasoning = _optional_str(raw, "reasoning_content", param)
        if reasoning is None:
            reasoning = _optional_str(raw, "reasoning", param)
    elif raw.get("tool_calls"):
        raise bad_request(f"'{param}.tool_calls' is only allowed on assistant messages.", param=f"{param}.tool_calls")
    return Message(
        role=role,
        content=content,
        name=name,
        tool_call_id=tool_call_id,
        tool_calls=tool_calls,
        reasoning_content=reasoning,
    )




def image_parts(messages: Sequence[Message]) -> list[ImagePart]:
    """The image parts of the history, in prompt order."""
    return [
        part
        for message in messages
        if isinstance(message.content, tuple)
        for part in message.content
        if isinstance(part, ImagePart)
    ]


def parse_messages(raw: Any) -> list[Message]:
    """Validate and normalise the request's ``messages`` array.

    :raises ApiError: 400 ``invalid_request_error`` with ``param`` naming the
        field; image violations carry code ``invalid_image``.
    """
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    messages = [_parse_message(item, f"messages[{index}]") for index, item in enumerate(raw)]
    images = [
        (index, part_index)
        for index, message in enumerate(messages)
        if isinstance(message.content, tuple)
        for part_index, part in enumerate(message.content)
        if isinstance(part, ImagePart)
    ]
    if len(images) > 1:
        index, part_index = images[1]
        raise bad_request(
            "At most one image is supported across the whole conversation history.",
            code="invalid_image",
            param=f"messages[{index}].content[{part_index}]",
        )
    return messages


def _parse_tool(raw: Any, param: str) -> ToolDef:
    _expect(raw, (dict,), "an object", param)
    function = raw
    if "function" in raw or "type" in raw:
        if raw.get("type", "function") != "function":
            raise bad_request(f"'{param}.type' must be 'function'.", param=f"{param}.type")
        function = raw.get("function")
        param = f"{param}.function"
        _expect(function, (dict,), "an object", param)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{param}.name' must be a non-empty string.", param=f"{param}.name")
    if any(ch in name for ch in '"<>\r\n\t ') or name.startswith(".") or name.endswith("."):
        raise bad_request(
            f"Tool name {name!r} contains characters that cannot appear in a tool call.",
            code="invalid_tool_schema",
            param=f"{param}.name",
        )
    description = _optional_str(function, "description", param)
    parameters = function.get("parameters")
    if parameters is not None:
        _expect(parameters, (dict,), "a JSON Schema object", f"{param}.parameters")
    strict = function.get("strict")
    if strict is not None:
        _expect(strict, (bool,), "a boolean", f"{param}.strict")
    return ToolDef(name=name, description=description, parameters=parameters, strict=strict)


def parse_tools(raw: Any) -> list[ToolDef]:
    """Validate the request's ``tools`` array (``null`` and ``[]``: no tools).

    Name collisions after aliasing are checked by the template, which knows
    whether tools are active.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("'tools' must be an array or null.", param="tools")
    return [_parse_tool(item, f"tools[{index}]") for index, item in enumerate(raw)]

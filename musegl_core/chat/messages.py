"""Chat messages and tool declarations as the template sees them.

These are the validated, normalised forms of the OpenAI request fields
(``messages``, ``tools``). They are structured from the raw JSON values by
:data:`converter`, a cattrs converter whose hooks hold the rules below;
:func:`parse_messages` and :func:`parse_tools` run it and turn the first
rule broken into an :class:`~musegl_core.errors.ApiError` (400
``invalid_request_error``) naming the offending field in ``param``
(``messages[2].content[0].text``): cattrs records where in the value each
failure happened, and the message is written with that path.

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

A field a message's role does not read is ignored (a user message's
``reasoning_content``), except ``tool_calls``, which only an assistant
message may carry. Missing fields read as ``null``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any, Union, get_origin

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote, ClassValidationError, IterableValidationNote
from cattrs.cols import list_structure_factory
from cattrs.gen import make_dict_structure_fn, override

from musegl_core.errors import ApiError, bad_request

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
    arguments: dict[str, Any] = attrs.field(factory=dict)  # parsed from the JSON string; key order preserved


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


# -- structuring ---------------------------------------------------------------------
class Refusal(ValueError):
    """A rule a field broke, raised by the converter's hooks.

    ``text`` is a :meth:`str.format` template: ``{param}`` is the path of the
    field at fault, ``{here}`` the path of the value the hook was given
    (``below`` leads from it to the field: ``.image_url.url``); ``values``
    fill the rest, so a client's text is never read as a template."""

    def __init__(self, text: str, *, code: str | None = None, below: str = "", **values: Any) -> None:
        super().__init__(text)
        self.text, self.code, self.below, self.values = text, code, below, values

    def error(self, here: str) -> ApiError:
        param = here + self.below
        return bad_request(self.text.format(param=param, here=here, **self.values), code=self.code, param=param)


#: Structures the chat fields; detailed validation keeps the path of every failure.
converter = cattrs.Converter(detailed_validation=True)

def structure(raw: Any, kind: Any, param: str) -> Any:
    """``raw`` (the JSON value at ``param``) structured as ``kind``; the first
    rule it breaks is a 400 naming the field below ``param``."""
    try:
        return converter.structure(raw, kind)
    except (Refusal, cattrs.BaseValidationError) as exc:
        refusal, path = _first_refusal(exc, param)
        raise refusal.error(path) from None


def _first_refusal(exc: BaseException, path: str) -> tuple[Refusal, str]:
    """The first failure under ``exc`` (fields in declaration order, items in
    order) and its path, from the notes cattrs leaves on each level."""
    while isinstance(exc, cattrs.BaseValidationError):
        exc = exc.exceptions[0]
        for note in getattr(exc, "__notes__", ()):
            if isinstance(note, AttributeValidationNote):
                path += f".{note.name}"
            elif isinstance(note, IterableValidationNote):
                path += f"[{note.index}]"
    if not isinstance(exc, Refusal):
        raise exc  # no rule names it: a fault of the hooks, not of the request
    return exc, path


def _field(raw: dict, key: str, kind: Any, owner: type) -> Any:
    """``raw[key]`` (missing: ``None``) structured as ``kind`` by a hand-made
    hook of ``owner``, its failures noted with the key as cattrs's own hooks do."""
    try:
        return converter.structure(raw.get(key), kind)
    except Exception as exc:
        exc.add_note(AttributeValidationNote(f"Structuring {owner.__name__}.{key}", key, kind))
        raise ClassValidationError(f"While structuring {owner.__name__}", [exc], owner) from None


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _expect(value: Any, kind: type, what: str, below: str = "") -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise Refusal("'{param}' must be {what}, got {got}.", below=below, what=what, got=_type_name(value))
    return value


converter.register_structure_hook(str, lambda value, _: _expect(value, str, "a string"))
converter.register_structure_hook(bool, lambda value, _: _expect(value, bool, "a boolean"))


def _strict_sequence(kind: Any, conv: cattrs.Converter) -> Any:
    """``list[X]`` and ``tuple[X, ...]``: a JSON array only (cattrs alone takes any iterable, a string too)."""
    items = list_structure_factory(kind, conv)
    make = tuple if get_origin(kind) is tuple else list

    def hook(value: Any, _: Any) -> Any:
        return make(items(_expect(value, list, "an array"), kind))

    return hook


def _object_factory(cls: type, conv: cattrs.Converter, **overrides: Any) -> Any:
    """An attrs class from a JSON object; a missing field without a default
    reads as ``null``, so its hook refuses it in the same words."""
    fields = make_dict_structure_fn(cls, conv, **overrides)
    required = [field.name for field in attrs.fields(cls) if field.default is attrs.NOTHING]

    def hook(value: Any, _: Any) -> Any:
        _expect(value, dict, "an object")
        missing = {name: None for name in required if name not in value}
        return fields({**value, **missing} if missing else value, cls)

    return hook


converter.register_structure_hook_factory(lambda kind: get_origin(kind) in (list, tuple), _strict_sequence)
converter.register_structure_hook_factory(attrs.has, _object_factory)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: the deepest nesting of arrays and objects JSON inside an ``arguments`` string may have (the body's own limit)
MAX_ARGUMENTS_DEPTH = 128


def _json_depth_over(value: Any, limit: int) -> bool:
    """``value`` nests arrays and objects more than ``limit`` levels (iterative)."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        items = value.values() if isinstance(value, dict) else value
        stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))
    return False


def _arguments(raw: Any, _: Any) -> dict[str, Any]:
    """Tool-call ``arguments``: a JSON string (the empty string: ``{}``) of an
    object, or already a mapping; the client's key order is kept. The JSON in
    the string may nest :data:`MAX_ARGUMENTS_DEPTH` levels, as the body may."""
    if isinstance(raw, dict):
        return raw
    _expect(raw, str, "a JSON string")
    if raw.strip() == "":
        return {}
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise Refusal("'{param}' is nested more than {limit} levels deep (arrays and objects).",
                      code="json_too_deep", limit=MAX_ARGUMENTS_DEPTH) from None
    except ValueError as exc:
        raise Refusal("'{param}' is not valid JSON: {exc}.", exc=exc) from None
    if not isinstance(value, dict):
        raise Refusal("'{param}' must encode a JSON object, got {got}.", got=_type_name(value))
    if _json_depth_over(value, MAX_ARGUMENTS_DEPTH):
        raise Refusal("'{param}' is nested more than {limit} levels deep (arrays and objects).",
                      code="json_too_deep", limit=MAX_ARGUMENTS_DEPTH)
    return value


def parse_json_arguments(raw: Any, param: str) -> dict[str, Any]:
    """Parse tool-call ``arguments`` (a JSON string, or already a mapping) into
    a ``dict`` with the client's key order. The empty string counts as ``{}``; anything that is not a JSON object is a 400."""
    try:
        return _arguments(raw, None)
    except Refusal as refusal:
        raise refusal.error(param) from None


def _function_name(raw: Any, _: Any) -> str:
    if not isinstance(raw, str) or not raw:
        raise Refusal("'{param}' must be a non-empty string.")
    return raw


converter.register_structure_hook(
    FunctionCall, _object_factory(FunctionCall, converter, name=override(struct_hook=_function_name),
                                  arguments=override(struct_hook=_arguments))
)
#: ``type`` first (absent or null: ``function``), then ``id`` and ``function``
_tool_call_fields = _object_factory(ToolCall, converter, type=override(omit=True))


def _tool_call(raw: Any, _: Any) -> ToolCall:
    _expect(raw, dict, "an object")
    if raw.get("type", "function") not in ("function", None):
        raise Refusal("'{param}' must be 'function'.", below=".type")
    return _tool_call_fields(raw, ToolCall)


converter.register_structure_hook(ToolCall, _tool_call)


def _image(part: Any, _: Any) -> ImagePart:
    """An ``image_url`` part: an inline PNG or JPEG, its bytes decoded."""
    image_url = part.get("image_url")
    if not isinstance(image_url, dict):
        raise Refusal("'{param}' must be an object with a 'url'.", below=".image_url")
    detail = image_url.get("detail")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise Refusal("Image 'detail' must be 'auto', 'low' or 'high', got {detail}.", code="invalid_image",
                      below=".image_url.detail", detail=json.dumps(detail)[:40])
    url = image_url.get("url")
    if not isinstance(url, str):
        raise Refusal("'{param}' must be a string.", code="invalid_image", below=".image_url.url")
    for prefix, media_type in IMAGE_URL_PREFIXES.items():
        if url[: len(prefix)].lower() == prefix:  # media types are case-insensitive
            break
    else:
        raise Refusal("{why}", code="invalid_image", below=".image_url.url", why=_unsupported_url(url))
    try:
        data = base64.b64decode(url[len(prefix) :], validate=True)
    except (binascii.Error, ValueError):
        raise Refusal("The image data is not valid base64.", code="invalid_image", below=".image_url.url") from None
    if not data:
        raise Refusal("The image data is empty.", code="invalid_image", below=".image_url.url")
    return ImagePart(url=url, media_type=media_type, data=data, detail=detail)


converter.register_structure_hook(ImagePart, _image)


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


def _part(raw: Any, _: Any) -> ContentPart:
    """A content part, by its ``type``: ``text`` or ``image_url``."""
    _expect(raw, dict, "an object")
    kind = raw.get("type")
    if kind == "text":
        return converter.structure(raw, TextPart)
    if kind == "image_url":
        return converter.structure(raw, ImagePart)
    raise Refusal("Unsupported content part type {kind!r} in '{here}'; only 'text' and 'image_url' parts are accepted.",
                  below=".type", kind=kind)


def _content(raw: Any, _: Any) -> Content:
    """A string, ``null`` or an array of content parts (a tuple once structured)."""
    if raw is None or isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise Refusal("'{param}' must be a string, null or an array of content parts.")
    return converter.structure(raw, tuple[ContentPart, ...])


converter.register_structure_hook_func(lambda kind: kind is ContentPart, _part)
converter.register_structure_hook_func(lambda kind: kind is Content, _content)


def _message(raw: Any, _: Any) -> Message:
    """A message; its role says which fields it reads (see the module docstring)."""
    _expect(raw, dict, "an object")
    role = raw.get("role")
    if role not in ROLES:
        raise Refusal("'{param}' must be one of {roles}; got {role!r}.", below=".role", roles=", ".join(ROLES),
                      role=role)
    if "content" not in raw and role != "assistant":
        raise Refusal("'{param}' is required for {role} messages.", below=".content", role=role)
    content = _field(raw, "content", Content, Message)
    if content is None and role != "assistant":
        raise Refusal("'{param}' must not be null for {role} messages.", below=".content", role=role)
    name = _field(raw, "name", str | None, Message)
    tool_call_id = _field(raw, "tool_call_id", str | None, Message) if role == "tool" else None
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning = None
    if role == "assistant":
        tool_calls = _field(raw, "tool_calls", tuple[ToolCall, ...] | None, Message) or ()
        reasoning = _field(raw, "reasoning_content", str | None, Message)
        if reasoning is None:
            reasoning = _field(raw, "reasoning", str | None, Message)
    elif raw.get("tool_calls"):
        raise Refusal("'{param}' is only allowed on assistant messages.", below=".tool_calls")
    return Message(role=role, content=content, name=name, tool_call_id=tool_call_id, tool_calls=tool_calls,
                   reasoning_content=reasoning)


converter.register_structure_hook(Message, _message)


def _tool_name(raw: Any, _: Any) -> str:
    name = _function_name(raw, _)
    if any(ch in name for ch in '"<>\r\n\t ') or name.startswith(".") or name.endswith("."):
        raise Refusal("Tool name {name!r} contains characters that cannot appear in a tool call.",
                      code="invalid_tool_schema", name=name)
    return name


def _schema(raw: Any, _: Any) -> dict[str, Any] | None:
    return None if raw is None else _expect(raw, dict, "a JSON Schema object")


#: the declared function's own fields (``name``, ``description``, ``parameters``, ``strict``)
_function_fields = _object_factory(
    ToolDef, converter, name=override(struct_hook=_tool_name), parameters=override(struct_hook=_schema)
)


def _tool(raw: Any, _: Any) -> ToolDef:
    """A tool: OpenAI's ``{"type": "function", "function": {...}}`` or the function bare."""
    _expect(raw, dict, "an object")
    if "function" not in raw and "type" not in raw:
        return _function_fields(raw, ToolDef)
    if raw.get("type", "function") != "function":
        raise Refusal("'{param}' must be 'function'.", below=".type")
    try:
        return _function_fields(raw.get("function"), ToolDef)
    except Exception as exc:
        exc.add_note(AttributeValidationNote("Structuring the tool's function", "function", ToolDef))
        raise ClassValidationError("While structuring ToolDef", [exc], ToolDef) from None


converter.register_structure_hook(ToolDef, _tool)


# -- entry points --------------------------------------------------------------------
def image_parts(messages: Sequence[Message]) -> list[ImagePart]:
    """The image parts of the history, in prompt order."""
    return [
        part
        for message in messages
        if isinstance(message.content, tuple)
        for part in message.content
        if isinstance(part, ImagePart)
    ]


def parse_content(raw: Any, param: str) -> Content:
    """A message's ``content`` at ``param`` (a string, ``null`` or parts), or a 400 naming the field."""
    return structure(raw, Content, param)


def parse_messages(raw: Any) -> list[Message]:
    """Validate and normalise the request's ``messages`` array.

    :raises ApiError: 400 ``invalid_request_error`` with ``param`` naming the
        field; image violations carry code ``invalid_image``.
    """
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array.", param="messages")
    messages = structure(raw, list[Message], "messages")
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


def parse_tools(raw: Any) -> list[ToolDef]:
    """Validate the request's ``tools`` array (``null`` and ``[]``: no tools).

    Name collisions after aliasing are checked by the template, which knows
    whether tools are active.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("'tools' must be an array or null.", param="tools")
    return structure(raw, list[ToolDef], "tools")

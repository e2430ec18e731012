"""A Messages request → the core's :class:`~musegl_core.service.conversation.Conversation`.

What maps to what (docs/anthropic.md has the user's view):

* ``system`` (a string or text blocks, joined by a blank line) is the first
  system message; ``system`` roles inside ``messages`` are system messages
  where they stand. Claude Code's billing block (``x-anthropic-billing-header:
  ...; cch=XXXXX;``) has its per-request ``cch`` nonce replaced by a constant
  before anything is tokenized, so the prompt prefix stays the same turn to turn.
* user ``text`` / ``image`` (base64 PNG or JPEG) blocks are a user message;
  ``tool_result`` blocks (string, or text and image blocks; ``is_error``
  prefixes the result with ``Error: ``) are tool messages, in block order.
* assistant ``thinking`` / ``text`` / ``tool_use`` blocks are assistant
  messages (a block that cannot follow the previous ones in one Muse message,
  such as thinking after text, starts the next). A thinking block whose
  ``signature`` this server sealed (and whose text, if any, is unchanged)
  goes back as the exact generated ids; any other is plain reasoning text.
  ``redacted_thinking`` is used only when its ``data`` is such a seal.
* ``tools`` (custom tools: ``name``, ``description``, ``input_schema``,
  ``strict``) are function tools; Anthropic's server tools (typed
  ``web_search_…``, ``bash_…``, ...) run on Anthropic's side, so they are
  left out of the prompt, and a ``tool_choice`` naming one is a 400.
* ``tool_choice``: ``auto``, ``any`` (a call is required), ``tool`` (that
  tool), ``none``; ``disable_parallel_tool_use`` allows one call.
* ``thinking``: ``enabled`` (``budget_tokens`` picks the reasoning strength:
  up to 2048 low, up to 8192 medium, above high) and ``adaptive`` return
  thinking blocks (``display: "omitted"``: empty text, signature kept);
  ``disabled`` or absent returns none. Muse always reasons: its tokens count
  in ``output_tokens`` either way. ``output_config.effort`` (low, medium,
  high; xhigh and max are high, the most this model has) sets the strength
  and wins over ``budget_tokens``.
* ``output_config.format`` (``json_schema``) constrains the answer with the
  core's constrained decoding.

Everything else a request may say that this server cannot honour is a 400
naming it.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

import attrs

from musegl_core.chat.channels import parse_output
from musegl_core.chat.messages import FunctionCall, ImagePart, Message, TextPart, ToolCall, ToolDef
from musegl_core.chat.template import TemplateVariables
from musegl_core.engine.executor import SamplingParams
from musegl_core.errors import ApiError, bad_request, unsupported
from musegl_core.service.retention import anthropic_ttl
from musegl_core.service.rules import cache_salt, session_id as checked_session_id
from musegl_core.service.conversation import AnswerFormat, Conversation, Settings, ToolChoice
from musegl_core.service.sessions import client_session, explicit_header_session
from musegl_anthropic.schemas import MessagesRequest

IMAGE_TYPES = ("image/png", "image/jpeg")
MAX_STOPS = 64
SESSION_HEADER = "x-claude-code-session-id"
BILLING_PREFIX = "x-anthropic-billing-header:"
_NONCE = re.compile(r"\bcch=[^;\s]*")
#: ``cc_version=2.1.328.a1f``: the 3-hex suffix is a fingerprint of the conversation's first user message
_FINGERPRINT = re.compile(r"\b(cc_version=\d+\.\d+\.\d+)\.[0-9A-Fa-f]{3}(?=[;\s]|$)")
#: ``output_config.effort`` → the template's reasoning strength
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
SERVER_TOOL = re.compile(r"^[a-z_]+_\d{8}$")  # web_search_20250305, bash_20250124, ...


@attrs.frozen
class MessagesCall:
    """A checked request: the conversation and how to present the answer."""

    conversation: Conversation
    model: str
    stream: bool
    show_thinking: bool  # thinking blocks are returned
    omit_thinking_text: bool  # ... with empty text (display "omitted" or "updates"), signature kept
    #: the safeguards the request asked for, answered "unsupported" (no safety classifier runs here)
    safeguards: tuple[str, ...] = ()
    image_at: str | None = None  # the first image block (``messages[2].content[0]``), if any


def no_vision(param: str) -> ApiError:
    """The 400 for an image sent to a model that reads none, in the shape Claude Code handles:
    Anthropic's dotted block path (``messages.2.content.0.image``, or
    ``messages.2.content.0.tool_result.content.1.image`` for an image in a tool result) and
    "Could not process image". Claude Code then drops that image and resends the request
    (docs/anthropic.md)."""
    indices = re.findall(r"\[(\d+)\]", param)
    path = f"messages.{indices[0]}.content.{indices[1]}"
    if len(indices) > 2:
        path += f".tool_result.content.{indices[2]}"
    path += ".image"
    return ApiError(400, f"{path}: Could not process image: this model reads no images (it was loaded without "
                         "a vision projector); send text only", "invalid_request_error", "invalid_image", path)


def _type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def _expect(value: Any, kinds: tuple[type, ...], what: str, param: str) -> Any:
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"'{param}' must be {what}, got {_type(value)}", param=param)
    return value


def _keys(block: dict, allowed: set[str], param: str) -> None:
    """A key outside ``allowed`` is a 400 naming it; one whose value is null counts as absent
    (the SDKs write every field of a block they parsed, unset ones as null)."""
    unknown = sorted(key for key, value in block.items() if key not in allowed and value is not None)
    if unknown:
        raise unsupported(f"{param}.{unknown[0]}", f"'{param}.{unknown[0]}' is not supported by this server")


def normalise_billing(text: str) -> str:
    """Claude Code's billing block with its client nonces made constant: the per-request
    ``cch`` value becomes ``cch=0``, and the per-conversation fingerprint suffix of
    ``cc_version`` is dropped (``cc_version=2.1.328.a1f`` -> ``cc_version=2.1.328``), so
    that every conversation of one client version shares the prompt prefix."""
    if text.startswith(BILLING_PREFIX):
        return _FINGERPRINT.sub(r"\1", _NONCE.sub("cch=0", text))
    return text


# -- content -------------------------------------------------------------------------------
class _Reader:
    """Reads one request's messages; counts images (one per conversation)."""

    def __init__(self, seal: Any, tokenizer: Any):
        self.seal = seal
        self.tokenizer = tokenizer
        self.images = 0
        self.image_at: str | None = None  # the first image block's param

    def text_blocks(self, raw: Any, param: str) -> str:
        """A string, or text blocks joined by a blank line (``system``)."""
        if isinstance(raw, str):
            return normalise_billing(raw)
        _expect(raw, (list,), "a string or an array of text blocks", param)
        texts = []
        for index, block in enumerate(raw):
            where = f"{param}[{index}]"
            _expect(block, (dict,), "a text block", where)
            if block.get("type") != "text":
                raise bad_request(f"'{where}.type' must be 'text'", param=f"{where}.type")
            _keys(block, {"type", "text", "cache_control", "citations"}, where)
            texts.append(normalise_billing(_expect(block.get("text"), (str,), "a string", f"{where}.text")))
        return "\n\n".join(texts)

    def image(self, block: dict, param: str) -> ImagePart:
        _keys(block, {"type", "source", "cache_control"}, param)
        source = _expect(block.get("source"), (dict,), "an object", f"{param}.source")
        kind = source.get("type")
        if kind != "base64":
            raise bad_request(
                f"image source type {kind!r} is not supported: send the image inline as base64 "
                "(URLs and files are not fetched)", code="invalid_image", param=f"{param}.source.type")
        _keys(source, {"type", "media_type", "data"}, f"{param}.source")
        media = source.get("media_type")
        if media not in IMAGE_TYPES:
            raise bad_request(f"image media_type must be image/png or image/jpeg, got {media!r}",
                              code="invalid_image", param=f"{param}.source.media_type")
        data = _expect(source.get("data"), (str,), "a string", f"{param}.source.data")
        try:
            decoded = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("the image data is not valid base64", code="invalid_image",
                              param=f"{param}.source.data") from None
        if not decoded:
            raise bad_request("the image data is empty", code="invalid_image", param=f"{param}.source.data")
        self.images += 1
        self.image_at = self.image_at or param
        if self.images > 1:
            raise bad_request("at most one image is supported across the whole conversation",
                              code="invalid_image", param=param)
        return ImagePart(url=f"data:{media};base64,{data}", media_type=media, data=decoded)

    def parts(self, blocks: list, param: str, kinds: tuple[str, ...]) -> tuple:
        parts = []
        for index, block in enumerate(blocks):
            where = f"{param}[{index}]"
            _expect(block, (dict,), "a content block", where)
            kind = block.get("type")
            if kind == "text" and "text" in kinds:
                _keys(block, {"type", "text", "cache_control", "citations"}, where)
                parts.append(TextPart(_expect(block.get("text"), (str,), "a string", f"{where}.text")))
            elif kind == "image" and "image" in kinds:
                parts.append(self.image(block, where))
            else:
                raise unsupported(f"{where}.type", f"content block type {kind!r} is not supported here")
        return tuple(parts)

    def tool_result(self, block: dict, param: str) -> Message:
        _keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, param)
        call_id = _expect(block.get("tool_use_id"), (str,), "a string", f"{param}.tool_use_id")
        raw = block.get("content", "")
        content: Any = raw if isinstance(raw, str) else self.parts(
            _expect(raw, (list,), "a string or an array of text and image blocks", f"{param}.content"),
            f"{param}.content", ("text", "image"))
        is_error = block.get("is_error")
        if is_error is not None and not isinstance(is_error, bool):
            raise bad_request(f"'{param}.is_error' must be a boolean", param=f"{param}.is_error")
        if is_error:
            content = f"Error: {content}" if isinstance(content, str) else (TextPart("Error: "), *content)
        return Message(role="tool", content=content, tool_call_id=call_id)

    def user(self, content: Any, param: str) -> list[Message]:
        if isinstance(content, str):
            return [Message(role="user", content=content)]
        _expect(content, (list,), "a string or an array of content blocks", param)
        out: list[Message] = []
        pending: list = []
        for index, block in enumerate(content):
            where = f"{param}[{index}]"
            _expect(block, (dict,), "a content block", where)
            if block.get("type") == "tool_result":
                if pending:
                    out.append(Message(role="user", content=tuple(pending)))
                    pending = []
                out.append(self.tool_result(block, where))
            else:
                pending += self._one(block, where)
        if pending or not out:
            out.append(Message(role="user", content=tuple(pending)))
        return out

    def _one(self, block: dict, where: str) -> list:
        kind = block.get("type")
        if kind == "text":
            _keys(block, {"type", "text", "cache_control", "citations"}, where)
            return [TextPart(_expect(block.get("text"), (str,), "a string", f"{where}.text"))]
        if kind == "image":
            return [self.image(block, where)]
        raise unsupported(f"{where}.type", f"content block type {kind!r} is not supported in a user message")

    def assistant(self, content: Any, param: str) -> list[Message]:
        if isinstance(content, str):
            return [Message(role="assistant", content=content)]
        _expect(content, (list,), "a string or an array of content blocks", param)
        out: list[Message] = []
        current: dict[str, Any] = {}

        def flush() -> None:
            if current:
                out.append(Message(role="assistant", content=current.get("text"),
                                   reasoning_content=current.get("reasoning"),
                                   reasoning_ids=current.get("sealed"),
                                   tool_calls=tuple(current.get("calls", ()))))
                current.clear()

        for index, block in enumerate(content):
            where = f"{param}[{index}]"
            _expect(block, (dict,), "a content block", where)
            kind = block.get("type")
            if kind in ("thinking", "redacted_thinking"):
                text, sealed = self.thinking(block, where)
                if text is None:
                    continue  # an opaque block this server did not make: nothing to show the model
                if current:
                    flush()
                current["reasoning"], current["sealed"] = text, sealed
            elif kind == "text":
                _keys(block, {"type", "text", "cache_control", "citations"}, where)
                text = _expect(block.get("text"), (str,), "a string", f"{where}.text")
                if "calls" in current:
                    flush()
                current["text"] = current.get("text", "") + text
            elif kind == "tool_use":
                _keys(block, {"type", "id", "name", "input", "cache_control", "caller"}, where)
                call_id = _expect(block.get("id"), (str,), "a string", f"{where}.id")
                name = _expect(block.get("name"), (str,), "a string", f"{where}.name")
                arguments = _expect(block.get("input"), (dict,), "an object", f"{where}.input")
                current.setdefault("calls", []).append(ToolCall(id=call_id, function=FunctionCall(name, arguments)))
            else:
                raise unsupported(f"{where}.type", f"content block type {kind!r} is not supported in an "
                                                   "assistant message")
        flush()
        return out or [Message(role="assistant", content="")]

    def thinking(self, block: dict, param: str) -> tuple[str | None, Any]:
        """The reasoning text of an echoed block and its verified ids (or None)."""
        if block.get("type") == "redacted_thinking":
            _keys(block, {"type", "data", "cache_control"}, param)
            sealed = self.seal.open(block.get("data"))
            decoded = self._decoded(sealed) if sealed is not None else None
            return (decoded, sealed) if decoded else (None, None)
        _keys(block, {"type", "thinking", "signature", "cache_control"}, param)
        text = _expect(block.get("thinking", ""), (str,), "a string", f"{param}.thinking")
        signature = block.get("signature")
        if signature is not None and not isinstance(signature, str):
            raise bad_request(f"'{param}.signature' must be a string", param=f"{param}.signature")
        sealed = self.seal.open(signature)
        decoded = self._decoded(sealed) if sealed is not None else None
        if decoded and (not text or text == decoded):
            return decoded, sealed  # the very ids this server generated
        return (text or None), None  # unverifiable (or edited): the text, as plain reasoning

    def _decoded(self, sealed: Any) -> str | None:
        if self.tokenizer is None:
            return None
        return parse_output(self.tokenizer.decode(list(sealed.ids)), tools_active=False).reasoning


def read_messages(raw: Any, system: Any, reader: _Reader) -> tuple[list[Message], str | None]:
    """The conversation, and the reasoning strength of the last system message in ``messages``
    that sets ``output_config.effort`` (Claude Code's per-turn effort), or None."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", param="messages")
    out: list[Message] = []
    turn_effort = None
    if system is not None:
        text = reader.text_blocks(system, "system")
        if text:
            out.append(Message(role="system", content=text))
    for index, message in enumerate(raw):
        param = f"messages[{index}]"
        _expect(message, (dict,), "an object", param)
        role = message.get("role")
        _keys(message, {"role", "content", "output_config"} if role == "system" else {"role", "content"}, param)
        if "content" not in message:
            raise bad_request(f"'{param}.content' is required", param=f"{param}.content")
        content = message.get("content")
        if role == "user":
            out += reader.user(content, f"{param}.content")
        elif role == "assistant":
            out += reader.assistant(content, f"{param}.content")
        elif role == "system":
            out.append(Message(role="system", content=reader.text_blocks(content, f"{param}.content")))
            turn_effort = read_turn_effort(message.get("output_config"), f"{param}.output_config") or turn_effort
        else:
            raise bad_request(f"'{param}.role' must be user, assistant or system; got {role!r}", param=f"{param}.role")
    if out[-1].role == "assistant":
        raise unsupported(f"messages[{len(raw) - 1}]",
                          "a final assistant message (prefill: continuing it in place) is not supported; "
                          "end the conversation with a user message")
    return out, turn_effort


def read_turn_effort(raw: Any, param: str) -> str | None:
    """A system message's ``output_config`` (beta per-turn-control): ``effort`` only."""
    if raw is None:
        return None
    _expect(raw, (dict,), "an object", param)
    _keys(raw, {"effort"}, param)
    value = raw.get("effort")
    if value is not None and value not in EFFORTS:
        raise bad_request(f"'{param}.effort' must be low, medium, high, xhigh or max", param=f"{param}.effort")
    return None if value is None else EFFORTS[value]


#: The safeguards Claude Code may ask for (auto permission mode): a server-side classifier of its tool uses.
SAFEGUARD_TYPES = ("dangerous_tool_use",)


def read_safeguards(raw: Any) -> tuple[str, ...]:
    """The ``safeguards`` array's types. No classifier runs here: each is answered
    ``unsupported`` in ``safeguard_results``, and the client classifies locally."""
    if raw is None:
        return ()
    _expect(raw, (list,), "an array", "safeguards")
    kinds = []
    for index, item in enumerate(raw):
        where = f"safeguards[{index}]"
        _expect(item, (dict,), "an object", where)
        kind = item.get("type")
        if kind not in SAFEGUARD_TYPES:
            raise unsupported(f"{where}.type", f"safeguard type {kind!r} is not supported (dangerous_tool_use)")
        kinds.append(kind)
    return tuple(dict.fromkeys(kinds))


# -- tools ---------------------------------------------------------------------------------
def read_tools(raw: Any) -> tuple[tuple[ToolDef, ...], set[str]]:
    """The custom tools, and the names of the server tools left out."""
    if raw is None:
        return (), set()
    tools, server = [], set()
    for index, tool in enumerate(raw):
        param = f"tools[{index}]"
        _expect(tool, (dict,), "an object", param)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            if isinstance(kind, str) and SERVER_TOOL.match(kind):
                server.add(str(tool.get("name", kind)))
                continue  # Anthropic runs these on its side; there is nothing to run here
            raise unsupported(f"{param}.type", f"tool type {kind!r} is not supported")
        _keys(tool, {"type", "name", "description", "input_schema", "strict", "cache_control", "defer_loading",
                     "eager_input_streaming", "input_examples", "allowed_callers"}, param)
        name = _expect(tool.get("name"), (str,), "a string", f"{param}.name")
        if not name or any(ch in name for ch in '"<>\r\n\t ') or name.startswith(".") or name.endswith("."):
            raise bad_request(f"tool name {name!r} cannot appear in a tool call", code="invalid_tool_schema",
                              param=f"{param}.name")
        description = tool.get("description")
        if description is not None:
            _expect(description, (str,), "a string", f"{param}.description")
        schema = _expect(tool.get("input_schema"), (dict,), "a JSON Schema object", f"{param}.input_schema")
        strict = tool.get("strict")
        if strict is not None:
            _expect(strict, (bool,), "a boolean", f"{param}.strict")
        tools.append(ToolDef(name=name, description=description, parameters=schema, strict=strict))
    return tuple(tools), server


def read_tool_choice(raw: Any, tools: tuple[ToolDef, ...], server: set[str]) -> ToolChoice:
    if raw is None:
        return ToolChoice("auto")
    _expect(raw, (dict,), "an object", "tool_choice")
    kind = raw.get("type")
    _keys(raw, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    single = raw.get("disable_parallel_tool_use")
    if single is not None:
        _expect(single, (bool,), "a boolean", "tool_choice.disable_parallel_tool_use")
        if kind == "none":
            single = None
    parallel = {} if not single else {"parallel": False}
    if kind == "auto":
        return _choice("auto", None, parallel)
    if kind == "none":
        return ToolChoice("none")
    if kind == "any":
        return _choice("required", None, parallel)
    if kind == "tool":
        name = _expect(raw.get("name"), (str,), "a string", "tool_choice.name")
        if name in server:
            raise unsupported("tool_choice.name", f"{name!r} is one of Anthropic's server tools, which this "
                                                  "server does not run")
        if name not in {tool.name for tool in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice.name")
        return _choice("named", name, parallel)
    raise bad_request("'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")


def _choice(mode: str, name: str | None, parallel: dict) -> ToolChoice:
    return ToolChoice(mode, name, **parallel)


# -- generation settings -------------------------------------------------------------------
def read_thinking(raw: Any, max_tokens: int | None) -> tuple[str | None, bool, bool]:
    """``(reasoning strength from the budget, show thinking, omit its text)``."""
    if raw is None:
        return None, False, False
    _expect(raw, (dict,), "an object", "thinking")
    kind = raw.get("type")
    if kind == "disabled":
        _keys(raw, {"type"}, "thinking")
        return None, False, False
    if kind not in ("enabled", "adaptive"):
        raise unsupported("thinking.type", f"thinking type {kind!r} is not supported (enabled, adaptive, disabled)")
    _keys(raw, {"type", "budget_tokens", "display"}, "thinking")
    display = raw.get("display")
    if display not in (None, "summarized", "omitted", "updates"):
        raise bad_request("'thinking.display' must be summarized, omitted or updates", param="thinking.display")
    strength = None
    if kind == "enabled":
        budget = _expect(raw.get("budget_tokens"), (int,), "an integer", "thinking.budget_tokens")
        if budget < 1024:
            raise bad_request("'thinking.budget_tokens' must be at least 1024", param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise bad_request("'thinking.budget_tokens' must be less than 'max_tokens'",
                              param="thinking.budget_tokens")
        strength = "low" if budget <= 2048 else "medium" if budget <= 8192 else "high"
    elif "budget_tokens" in raw:
        raise bad_request("'thinking.budget_tokens' goes with type 'enabled'", param="thinking.budget_tokens")
    # "updates" asks for progress updates in place of the reasoning text, which this model does not
    # write: the blocks come as for "omitted" (empty text, the signature that restores the reasoning)
    return strength, True, display in ("omitted", "updates")


def read_output_config(raw: Any, legacy: Any) -> tuple[str | None, AnswerFormat | None]:
    """``(reasoning strength from effort, answer format)``."""
    effort, fmt, fmt_param = None, None, "output_config.format"
    if raw is not None:
        _expect(raw, (dict,), "an object", "output_config")
        _keys(raw, {"effort", "format"}, "output_config")
        value = raw.get("effort")
        if value is not None:
            if value not in EFFORTS:
                raise bad_request("'output_config.effort' must be low, medium, high, xhigh or max",
                                  param="output_config.effort")
            effort = EFFORTS[value]
        fmt = raw.get("format")
    if legacy is not None:
        if fmt is not None:
            raise bad_request("send 'output_config.format' or 'output_format', not both", param="output_format")
        fmt, fmt_param = legacy, "output_format"
    if fmt is None:
        return effort, None
    _expect(fmt, (dict,), "an object", fmt_param)
    _keys(fmt, {"type", "schema"}, fmt_param)
    if fmt.get("type") != "json_schema":
        raise unsupported(f"{fmt_param}.type", "the only output format is json_schema")
    schema = fmt.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{fmt_param}.schema' must be a JSON Schema", param=f"{fmt_param}.schema")
    return effort, AnswerFormat(schema, f"{fmt_param}.schema")


def read_sampling(request: MessagesRequest) -> SamplingParams:
    """Anthropic's ranges: ``temperature`` 0..1, ``top_p`` (0, 1], ``top_k`` >= 0."""
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0.0 <= temperature <= 1.0:
        raise bad_request(f"'temperature' must be between 0 and 1, got {temperature}", param="temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    top_k = 0 if request.top_k is None else request.top_k
    if top_k < 0:
        raise bad_request(f"'top_k' must be 0 (off) or positive, got {top_k}", param="top_k")
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k)


def read_stops(stops: list[str] | None) -> tuple[str, ...]:
    if not stops:
        return ()
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop_sequences' takes at most {MAX_STOPS} strings", param="stop_sequences")
    for index, text in enumerate(stops):
        if not text:
            raise bad_request("stop sequences must not be empty", param=f"stop_sequences[{index}]")
    return tuple(dict.fromkeys(stops))


def check_refused(request: MessagesRequest) -> None:
    """Fields musegl accepts only when they ask for nothing."""
    for name in ("container", "mcp_servers", "diagnostics"):
        value = getattr(request, name)
        if value not in (None, [], {}):
            raise unsupported(name, f"'{name}' is not supported by this server")
    if request.metadata is not None:
        _expect(request.metadata, (dict,), "an object", "metadata")
        _keys(request.metadata, {"user_id"}, "metadata")


def cache_control_markers(request: MessagesRequest):
    """Every ``cache_control`` of a request with the param it sits at: the top level, system
    blocks, message content blocks (and a tool result's own blocks), and tools."""
    yield request.cache_control, "cache_control"

    def blocks(raw: Any, param: str):
        if not isinstance(raw, list):
            return
        for index, block in enumerate(raw):
            if isinstance(block, dict):
                yield block.get("cache_control"), f"{param}[{index}].cache_control"
                yield from blocks(block.get("content"), f"{param}[{index}].content")

    yield from blocks(request.system, "system")
    for index, message in enumerate(request.messages if isinstance(request.messages, list) else ()):
        if isinstance(message, dict):
            yield from blocks(message.get("content"), f"messages[{index}].content")
    for index, tool in enumerate(request.tools or ()):
        if isinstance(tool, dict):
            yield tool.get("cache_control"), f"tools[{index}].cache_control"


def read_request(request: MessagesRequest, *, headers: Any, seal: Any, tokenizer: Any,
                 counting: bool = False) -> MessagesCall:
    """Check ``request`` and build its conversation; raises :class:`ApiError` (400)."""
    if request.model is None:
        raise bad_request("'model' is required", param="model")
    check_refused(request)
    max_tokens = request.max_tokens
    if not counting:
        if max_tokens is None:
            raise bad_request("'max_tokens' is required", param="max_tokens")
        if max_tokens < 1:
            raise bad_request(f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
    budget_strength, show, omit = read_thinking(request.thinking, None if counting else max_tokens)
    effort, answer = read_output_config(request.output_config, request.output_format)
    tools, server = read_tools(request.tools)
    choice = read_tool_choice(request.tool_choice, tools, server)
    reader = _Reader(seal, tokenizer)
    messages, turn_effort = read_messages(request.messages, request.system, reader)
    safeguards = read_safeguards(request.safeguards)
    retention = anthropic_ttl(cache_control_markers(request))  # "5m" and "1h" are honoured on every server
    explicit = explicit_header_session(headers)
    if explicit is not None:
        explicit = checked_session_id(None, explicit)
    session, soft = client_session(explicit, [("claude-code", headers.get(SESSION_HEADER)),
                                              ("opencode", headers.get("x-session-affinity"))])
    stream = bool(request.stream) and not counting
    settings = Settings(
        max_tokens=max_tokens,
        sampling=read_sampling(request),
        stop=read_stops(request.stop_sequences),
        clamp_to_context=True,  # max_tokens caps the answer; a full context ends it (model_context_window_exceeded)
        session_id=session,
        soft_session=soft,
        stream=stream,
        cache_salt=cache_salt(request.cache_salt),
        # the special tokens the output grammar does not use (<|reserved_special_token_5|>, <|patch|>)
        # never reach a text or thinking block: the API has no field to ask for them, and no client wants them
        special_tokens="control",
        retention=retention,
    )
    conversation = Conversation(
        messages=messages,
        settings=settings,
        tools=tools,
        tool_choice=choice,
        variables=TemplateVariables(reasoning_strength=turn_effort or effort or budget_strength),
        answer=answer,
        hide_reasoning=not show,
        tool_block_once=True,
    )
    return MessagesCall(conversation, request.model, stream, show, omit, safeguards, reader.image_at)

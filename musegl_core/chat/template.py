'''The Muse Glimmer chat template (``muse``): the official template's output, byte for byte.

:class:`MuseTemplate` renders validated messages and tools into ordered
:class:`~musegl_core.worker.messages.PromptSegment` objects. Everything the
template itself writes (headers, control tokens, the system preamble, the tool
block text) is a ``special=True`` segment; every piece of text a client wrote
(message content, names, ids, arguments, reasoning, tool descriptions and
schemas) is a ``special=False`` segment, so that a client typing ``<|eot|>``
never injects a control token.

The rendering is the official template's plus musegl's own rules:
developer messages render as system messages, commentary next to tool calls is
kept, flat tool names are aliased ``name.name``, tool definitions are
normalised, and ``tool_choice: "none"`` makes the tools inactive.
'''

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from musegl_core.chat.messages import ImagePart, Message, TextPart, ToolDef
from musegl_core.chat.tools import namespace_of, prompt_name, tool_aliases
from musegl_core.errors import bad_request
from musegl_core.prompt import PromptSegment

BOS = "<|begin_of_text|>"
START = "<|start|>"
MESSAGE = "<|message|>"
EOM = "<|eom|>"
EOT = "<|eot|>"
PATCH = "<|patch|>"

REASONING_STRENGTHS = ("low", "medium", "high")
DEFAULT_REASONING_STRENGTH = "high"
DEFAULT_KNOWLEDGE_CUTOFF = "2026-01-04"

#: The four casings that system-text normalisation rewrites.
_EFFORT_CASINGS = (
    ("Reasoning effort", "Reasoning strength"),
    ("Reasoning Effort", "Reasoning Strength"),
    ("reasoning effort", "reasoning strength"),
    ("REASONING EFFORT", "REASONING STRENGTH"),
)

_TOOL_BLOCK_HEAD = """In this environment you have access to a set of tools you can use to answer the user's question.

You can invoke a function by writing a "<atem:function_calls>" block like the following:
<atem:function_calls>
<atem:invoke name="$FUNCTION_NAME">
<atem:parameter name="$PARAMETER_NAME">$PARAMETER_VALUE</atem:parameter>
...
</atem:invoke>
</atem:function_calls>

String and scalar parameters should be specified as is, while lists and objects should use JSON format. Note that spaces for string values are not stripped. The output is not expected to be valid XML and is parsed with regular expressions.
Here are the functions available in JSONSchema format:
// Tool metadata
"""

_TOOL_BLOCK_MIDDLE = "// Function schemas\n"

_TOOL_BLOCK_TAIL = """
Here's an example of how to call a function in the tool set:
(If the tool namespace is not specified, invoke the function directly as `example_function_name` rather than `example_tool_name.example_function_name`)

to=example_tool_name.example_function_name

<atem:function_calls>
<atem:invoke name="example_tool_name.example_function_name">
<atem:parameter name="example_parameter_1">value_1</atem:parameter>
<atem:parameter name="example_parameter_2">This is the value for the second parameter
that can span
"multiple" lines
</atem:parameter>
</atem:invoke>
</atem:function_calls>"""

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def to_json(value: Any) -> str:
    """JSON as the template writes it: Python ``json.dumps`` separators, the
    client's key order, non-ASCII and HTML characters unescaped."""
    return json.dumps(value, ensure_ascii=False)


def render_value(value: Any) -> str:
    """An ATEM parameter value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (dict, list, tuple)):
        return to_json(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(value)
    raise TypeError(f"cannot render a {type(value).__name__} as a tool-call argument")


def _check_reasoning_strength(value: Any, param: str) -> str | None:
    if value is None or value == "":
        return None
    if value not in REASONING_STRENGTHS:
        raise bad_request(
            f"'{param}' must be one of {', '.join(REASONING_STRENGTHS)}; got {value!r}.",
            code="unsupported_parameter",
            param=param,
        )
    return value


@attrs.frozen
class TemplateVariables:
    """The template variables a request may set (``chat_template_kwargs``).

    ``reasoning_strength`` is normally set from ``reasoning_effort`` /
    ``reasoning.effort``; ``None`` means the template default ``high``.
    ``current_date`` (``None``: today on the server's clock, ``%Y-%m-%d``) and
    ``knowledge_cutoff`` appear in the default system block.
    ``tool_namespace_descriptions`` maps a namespace to its metadata line's
    description (default ``""``).
    """

    reasoning_strength: str | None = None
    current_date: str | None = None
    knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF
    tool_namespace_descriptions: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_kwargs(cls, kwargs: Any, *, param: str = "chat_template_kwargs") -> TemplateVariables:
        """Validate a ``chat_template_kwargs`` object; unknown keys or wrong
        types are a 400 naming the key."""
        if kwargs is None:
            return cls()
        if not isinstance(kwargs, dict):
            raise bad_request(f"'{param}' must be an object.", param=param)
        fields = {field.name for field in attrs.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            key_param = f"{param}.{key}"
            if key not in fields:
                raise bad_request(
                    f"Unknown template variable {key!r}; accepted: {', '.join(sorted(fields))}.",
                    code="unsupported_parameter",
                    param=key_param,
                )
            if value is None:
                continue
            if key == "tool_namespace_descriptions":
                if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()
                ):
                    raise bad_request(f"'{key_param}' must map namespaces to strings.", param=key_param)
            elif not isinstance(value, str):
                raise bad_request(f"'{key_param}' must be a string.", param=key_param)
            values[key] = value
        values["reasoning_strength"] = _check_reasoning_strength(
            values.get("reasoning_strength"), f"{param}.reasoning_strength"
        )
        return cls(**values)


def reasoning_strength_from_request(reasoning_effort: Any = None, reasoning: Any = None) -> str | None:
    """The ``reasoning_strength`` variable for a request.

    ``reasoning_effort`` is the OpenAI field, ``reasoning`` the OpenRouter
    object (only its ``effort`` key is read here; the HTTP layer validates its
    other keys). Accepted values are ``low``, ``medium``, ``high``; both given
    must agree. Returns ``None`` when neither is given.

    :raises ApiError: 400 ``unsupported_parameter`` otherwise.
    """
    effort = _check_reasoning_strength(reasoning_effort, "reasoning_effort")
    other = None
    if isinstance(reasoning, dict):
        other = _check_reasoning_strength(reasoning.get("effort"), "reasoning.effort")
    if effort is not None and other is not None and effort != other:
        raise bad_request(
            f"'reasoning_effort' ({effort!r}) and 'reasoning.effort' ({other!r}) disagree.",
            code="unsupported_parameter",
            param="reasoning.effort",
        )
    return effort or other


@attrs.frozen
class RenderedPrompt:
    """A rendered conversation.

    ``segments`` are in prompt order (see the module docstring for the
    ``special`` flag); ``text`` is their concatenation; ``tool_aliases`` maps
    each active tool's prompt name to the declared name (empty when tools are
    inactive); ``image_count`` counts the template-level ``<|patch|>``
    placeholders, one per image part, in order.
    """

    segments: tuple[PromptSegment, ...]
    text: str
    tool_aliases: dict[str, str]
    image_count: int = 0


class _PromptWriter:
    """Accumulates segments, merging neighbours with the same ``special`` flag."""

    def __init__(self) -> None:
        self._pieces: list[tuple[bool | None, str | tuple[int, ...]]] = []  # special None: token ids
        self.image_count = 0

    def special(self, text: str) -> None:
        self._add(True, text)

    def literal(self, text: str) -> None:
        self._add(False, text)

    def token_ids(self, ids: Sequence[int]) -> None:
        """Ids written as they are (a verified generated turn's reasoning)."""
        if ids:
            self._pieces.append((None, tuple(ids)))

    def _add(self, special: bool, text: str) -> None:
        if not text:
            return
        if self._pieces and self._pieces[-1][0] == special:
            self._pieces[-1] = (special, self._pieces[-1][1] + text)
        else:
            self._pieces.append((special, text))

    def result(self, aliases: dict[str, str]) -> RenderedPrompt:
        segments = tuple(
            PromptSegment(token_ids=piece) if special is None else PromptSegment(text=piece, special=special)
            for special, piece in self._pieces
        )
        return RenderedPrompt(
            segments=segments,
            text="".join(piece for special, piece in self._pieces if special is not None),
            tool_aliases=aliases,
            image_count=self.image_count,
        )


@attrs.frozen
class _ToolSet:
    """The active tools as the prompt shows them."""

    aliases: dict[str, str]  # prompt name -> declared name
    function_lines: tuple[str, ...]
    namespaces: tuple[str, ...]

    def prompt_name(self, name: str) -> str:
        """The prompt name for a name used in history: declared flat tools are
        aliased; anything else renders unchanged."""
        alias = prompt_name(name)
        return alias if self.aliases.get(alias) == name else name


_NO_TOOLS = _ToolSet({}, (), ())


def _tool_set(tools: Sequence[ToolDef]) -> _ToolSet:
    aliases = tool_aliases(tool.name for tool in tools)
    lines = []
    namespaces: dict[str, None] = {}
    for tool in tools:
        name = prompt_name(tool.name)
        namespaces.setdefault(namespace_of(name))
        parameters = _EMPTY_PARAMETERS if tool.parameters is None else tool.parameters
        lines.append(
            to_json({"name": name, "description": tool.description or "", "parameters": parameters})
        )
    return _ToolSet(aliases, tuple(lines), tuple(namespaces))


class MuseTemplate:
    """The ``muse`` chat template (the official template plus musegl's rules).

    ``today`` returns the date written into the default system block when the
    request does not set ``current_date``; the default is the server's local
    clock.
    """

    name = "muse"

    def __init__(self, *, today: Callable[[], datetime.date] = datetime.date.today) -> None:
        self._today = today

    def render(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolDef] | None = None,
        *,
        tools_active: bool = True,
        variables: TemplateVariables | None = None,
        tool_block_once: bool = False,
    ) -> RenderedPrompt:
        """Render a conversation, ending with the generation prompt.

        The generation prompt follows whatever the last message is: a final
        assistant message is closed history (``<|eot|>``, or ``<|eom|>`` where
        the same message mid-conversation would end so), as the official
        template renders it. Continuing it in place is not offered.

        ``tools_active=False`` is ``tool_choice: "none"``: no tool
        block, no aliasing, recipients ``"self", "user"`` only.

        ``tool_block_once=True`` (musegl's rule for the Anthropic surface,
        docs/anthropic.md): a system block after the first one is rendered
        without the tool block, which the first block already shows for the
        same tools; its text, reasoning line and recipients line are as the
        official template writes them. The default is the official template's
        rendering, the tool block in every system block.

        :raises ApiError: 400 for an empty conversation, tool-name collisions
            (``invalid_tool_schema``) or content the template cannot render.
        """
        variables = variables or TemplateVariables()
        _check_reasoning_strength(variables.reasoning_strength, "reasoning_strength")
        if not messages:
            raise bad_request("'messages' must be a non-empty array.", param="messages")
        toolset = _tool_set(tools) if tools and tools_active else _NO_TOOLS
        call_names = {
            call.id: call.function.name
            for message in messages
            if message.role == "assistant"
            for call in message.tool_calls
            if call.id is not None
        }

        out = _PromptWriter()
        out.special(BOS)
        if not any(message.role in ("system", "developer") for message in messages):
            self._default_system(out, toolset, variables)
        systems = 0
        for index, message in enumerate(messages):
            param = f"messages[{index}]"
            if message.role in ("system", "developer"):
                self._system(out, message, toolset, variables, param, tool_block=not (tool_block_once and systems))
                systems += 1
            elif message.role == "user":
                out.special(f"{START}user{MESSAGE}")
                self._content(out, message.content, param)
                out.special(EOT)
            elif message.role == "tool":
                self._tool_result(out, message, toolset, call_names, param)
            elif message.role == "assistant":
                followed_by_assistant = index + 1 < len(messages) and messages[index + 1].role == "assistant"
                self._assistant(out, message, toolset, followed_by_assistant, param)
            else:
                raise bad_request(f"Unknown role {message.role!r}.", param=f"{param}.role")
        out.special(f"{START}assistant")
        return out.result(dict(toolset.aliases))

    # -- blocks -------------------------------------------------------------------
    def _default_system(self, out: _PromptWriter, toolset: _ToolSet, variables: TemplateVariables) -> None:
        date = variables.current_date or self._today().strftime("%Y-%m-%d")
        out.special(f"{START}system{MESSAGE}You are a helpful AI assistant.\nKnowledge cutoff: ")
        out.literal(variables.knowledge_cutoff)
        out.special(".\nCurrent date: ")
        out.literal(date)
        out.special(".\n\n")
        self._reasoning_line(out, variables)
        self._system_tail(out, toolset, variables)

    def _system(
        self, out: _PromptWriter, message: Message, toolset: _ToolSet, variables: TemplateVariables, param: str,
        *, tool_block: bool = True,
    ) -> None:
        out.special(f"{START}system{MESSAGE}")
        normalised = _normalise_effort(message.content)
        text = self._content(out, normalised, param)
        if "reasoning strength" not in text.lower():
            out.special("\n\n")
            self._reasoning_line(out, variables)
        self._system_tail(out, toolset, variables, tool_block=tool_block)

    @staticmethod
    def _reasoning_line(out: _PromptWriter, variables: TemplateVariables) -> None:
        strength = variables.reasoning_strength or DEFAULT_REASONING_STRENGTH
        out.special(f"Reasoning strength: {strength}.")

    @staticmethod
    def _system_tail(out: _PromptWriter, toolset: _ToolSet, variables: TemplateVariables,
                     *, tool_block: bool = True) -> None:
        if toolset.aliases and tool_block:
            out.special("\n\n" + _TOOL_BLOCK_HEAD)
            descriptions = variables.tool_namespace_descriptions
            for namespace in toolset.namespaces:
                out.literal(to_json({"name": namespace, "description": descriptions.get(namespace, "")}) + "\n")
            out.special(_TOOL_BLOCK_MIDDLE)
            for line in toolset.function_lines:
                out.literal(line + "\n")
            out.special(_TOOL_BLOCK_TAIL)
        recipients = ['"self"', *(f'"{ns}.*"' for ns in toolset.namespaces), '"user"']
        out.special("\n\n# Valid recipients: ")
        out.literal(", ".join(recipients))
        out.special(f".{EOT}")

    def _tool_result(
        self,
        out: _PromptWriter,
        message: Message,
        toolset: _ToolSet,
        call_names: Mapping[str | None, str],
        param: str,
    ) -> None:
        if message.name:
            name = toolset.prompt_name(message.name)
        elif message.tool_call_id in call_names:
            name = toolset.prompt_name(call_names[message.tool_call_id])
        else:
            name = message.tool_call_id or ""
        out.special(f"{START}tool ")
        out.literal(name)
        out.special(f'{MESSAGE}<tool_output name="')
        out.literal(name)
        out.special('">\n')
        self._content(out, message.content, param)
        out.special(f"\n</tool_output>{EOT}")

    def _assistant(
        self, out: _PromptWriter, message: Message, toolset: _ToolSet, followed_by_assistant: bool, param: str
    ) -> None:
        sealed = message.reasoning_ids
        if sealed is not None and message.reasoning_content:
            # The ids the model generated for this reasoning (a verified seal): the
            # session's KV for them stays valid. A span that opened the turn follows
            # the generation prompt's header, which is written as the prompt wrote it.
            if sealed.opens_turn:
                out.special(f"{START}assistant")
            out.token_ids(sealed.ids)
        elif message.reasoning_content:
            out.special(f"{START}assistant to=self{MESSAGE}")
            out.literal(message.reasoning_content)
            out.special(EOM)
        if not message.tool_calls:
            recipient = message.recipient or "user"
            end_turn = message.end_turn if message.end_turn is not None else recipient == "user"
            out.special(f"{START}assistant to=")
            out.literal(recipient)
            out.special(MESSAGE)
            self._content(out, message.content, param)
            out.special(EOT if end_turn else EOM)
            return
        commentary = _PromptWriter()
        if self._content(commentary, message.content, param):
            out.special(f"{START}assistant to=user{MESSAGE}")
            self._content(out, message.content, param)
            out.special(EOM)
        last = len(message.tool_calls) - 1
        for index, call in enumerate(message.tool_calls):
            call_param = f"{param}.tool_calls[{index}]"
            name = toolset.prompt_name(call.function.name)
            out.special(f"{START}assistant to=")
            out.literal(name)
            out.special(f'{MESSAGE}<atem:function_calls>\n<atem:invoke name="')
            out.literal(name)
            out.special('">\n')
            if not isinstance(call.function.arguments, Mapping):
                raise bad_request(
                    "Tool-call arguments must be a JSON object.", param=f"{call_param}.function.arguments"
                )
            for key, value in call.function.arguments.items():
                out.special('<atem:parameter name="')
                out.literal(str(key))
                out.special('">')
                try:
                    out.literal(render_value(value))
                except TypeError as exc:
                    raise bad_request(str(exc), param=f"{call_param}.function.arguments.{key}") from None
                out.special("</atem:parameter>\n")
            out.special("</atem:invoke>\n</atem:function_calls>")
            out.special(EOM if index < last or followed_by_assistant else EOT)

    def _content(self, out: _PromptWriter, content: Any, param: str) -> str:
        """Render message content; returns the text it wrote."""
        if content is None:
            return ""
        if isinstance(content, str):
            out.literal(content)
            return content
        if not isinstance(content, Sequence):
            raise bad_request(f"'{param}.content' cannot be rendered.", param=f"{param}.content")
        written = []
        for index, part in enumerate(content):
            if isinstance(part, TextPart):
                out.literal(part.text)
                written.append(part.text)
            elif isinstance(part, ImagePart):
                out.special(PATCH)
                out.image_count += 1
                written.append(PATCH)
            else:
                raise bad_request(
                    f"'{param}.content[{index}]' cannot be rendered.", param=f"{param}.content[{index}]"
                )
        return "".join(written)


def _normalise_text(text: str) -> str:
    for old, new in _EFFORT_CASINGS:
        text = text.replace(old, new)
    return text


def _normalise_effort(content: Any) -> Any:
    """Rewrite the four "Reasoning effort" casings in system text."""
    if isinstance(content, str):
        return _normalise_text(content)
    if content is None:
        return None
    return tuple(TextPart(_normalise_text(part.text)) if isinstance(part, TextPart) else part for part in content)

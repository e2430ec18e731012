"""Output constraints of a chat request: ``response_format``, llama.cpp's
top-level ``json_schema`` and ``tool_choice`` ``"required"`` / a named function.

:func:`tool_choice_mode` reads ``tool_choice``; :func:`output_grammar` turns
the request into the grammar of its whole raw output
(:mod:`musegl_core.constrain.grammar`) or None. Everything runs in preflight:
a schema that fails the tool parser's schema preflight, or that llguidance
cannot express, is a 400 before anything reaches the worker — a constraint is
never silently dropped. See ``docs/constrained.md``.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from musegl_core.chat.messages import ToolDef
from musegl_core.constrain import grammar as g
from musegl_core.constrain.enforceable import unenforceable
from musegl_core.errors import ApiError, bad_request, unsupported


def preflight_schema(schema: Any, param: str, tool_parser: Any) -> None:
    """The tool parser's schema preflight (dialects, references, size budgets,
    tool-validation.md) for an answer schema; its 400 names ``param``."""
    if schema is True or tool_parser is None or tool_parser.prepare is None:
        return
    try:
        tool_parser.prepare([ToolDef(name="response_format", parameters=schema)])
    except ApiError as error:
        message = error.message.replace("Tool 'response_format' has an invalid parameters schema", "invalid schema")
        raise bad_request(message, code="invalid_json_schema", param=param) from None


def check_enforceable(schema: Any, param: str) -> None:
    """A 400 ``unsupported_schema`` naming ``param`` for a schema llguidance
    compiles but cannot enforce (no finite instance, an over-long forced
    pattern: :mod:`musegl_core.constrain.enforceable`)."""
    reason = unenforceable(schema)
    if reason is not None:
        raise bad_request(f"'{param}' cannot be enforced: {reason}", code="unsupported_schema", param=param)


def check_tool_schemas(tools: list[ToolDef], names: list[str] | None = None) -> None:
    """:func:`check_enforceable` for the parameters of the tools whose calls
    a grammar constrains (``names``; None: all), each named by its place."""
    for index, tool in enumerate(tools):
        if names is None or tool.name in names:
            check_enforceable(tool.parameters, f"tools[{index}].function.parameters")


def output_grammar(
    answer: tuple[Any, str] | None,
    *,
    config: Any,
    mode: str,
    named: str | None,
    tools_active: bool,
    tools: list[ToolDef],
    tool_parser: Any,
    prepared_tools: Any,
    aliases: dict[str, str],
    parallel: bool = True,
) -> str | None:
    """The grammar of the whole raw output, or None when nothing is constrained.

    ``answer`` is the JSON schema the final answer must satisfy and the
    parameter that asked for it (:func:`answer_schema`), or None."""
    forced_calls = mode in ("required", "named")
    if answer is None and not forced_calls:
        return None
    reasoning = config.constrained_reasoning_tokens
    call_rules = None
    if forced_calls or (answer is not None and tools_active):
        if not tools_active:
            raise bad_request(f"tool_choice {mode!r} needs tools", param="tool_choice")
        if tool_parser is None or getattr(tool_parser, "grammar", None) is None:
            raise unsupported("tool_choice", f"the tool parser {getattr(tool_parser, 'name', None)!r} "
                                             "cannot constrain tool calls")
        names = [t.name for t in tools]
        if mode == "named":
            if named not in names:
                raise bad_request(f"tool_choice names {named!r}, which is not among the declared tools",
                                  param="tool_choice")
            names = [named]
        check_tool_schemas(tools, names)
        call_rules = tool_parser.grammar(tools, {"aliases": aliases, "prepared": prepared_tools, "names": names})
    if forced_calls:
        param = "tool_choice"
    else:
        schema, param = answer
        check_enforceable(schema, param)  # first: its bounds are cheap to check, the preflight is not
        preflight_schema(schema, param, tool_parser)

    def whole(reasoning: int) -> str:
        if forced_calls:
            return g.calls_grammar(call_rules, reasoning, parallel)
        text = g.answer_grammar(schema, reasoning)
        if call_rules is not None:  # tools stay callable next to a JSON answer
            text = text.replace("start: reasoning? answer\n", "start: reasoning? (answer | calls)\n", 1)
            text = text.replace("start: answer\n", "start: answer | calls\n", 1)
            text += g.calls_rule(parallel) + call_rules
        return text

    text = whole(reasoning)
    if reasoning > 0 and g.nested_grammars(text) > g.MAX_NESTED_WITH_TOKEN_BOUND:
        text = whole(0)  # past llguidance's lexer classes with the reasoning bound: no reasoning message
    error = g.check(text)
    if error is not None:
        raise bad_request(f"the output constraint cannot be enforced: {_plain(error)}",
                          code="unsupported_schema", param=param)
    return text


def lazy_call_grammar(
    *,
    mode: str,
    tools_active: bool,
    tools: list[ToolDef],
    tool_parser: Any,
    prepared_tools: Any,
    aliases: dict[str, str],
    parallel: bool = True,
) -> Any:
    """``tool_choice`` ``"auto"`` with ``strict: true`` tools: the grammar the
    worker activates when the model opens a tool call
    (:class:`~musegl_core.engine.request.LazyGrammar`), or None.

    Calls to strict tools satisfy their schemas; calls to the other tools of
    the same request stay free after their opening tag (validated after
    generation, as without ``strict``). A strict tool the call grammar
    cannot express is a 400, never silently unconstrained."""
    strict = [t.name for t in tools if t.strict]
    if mode != "auto" or not tools_active or not strict:
        return None
    if tool_parser is None or getattr(tool_parser, "grammar", None) is None:
        raise unsupported("tools", f"the tool parser {getattr(tool_parser, 'name', None)!r} cannot constrain "
                                   "tool calls, so 'strict: true' cannot be honoured")
    check_tool_schemas(tools, strict)
    free = [t.name for t in tools if not t.strict]
    try:
        found = tool_parser.grammar(tools, {"aliases": aliases, "prepared": prepared_tools, "names": strict,
                                            "free_names": free, "lazy": True})
    except ApiError as error:  # the parser names tool_choice; here the strict tools ask for it
        raise attrs.evolve(error, param="tools") from None
    lazy = g.lazy_grammars(found["trigger"], found["rules"], parallel)
    for text in (lazy.in_tool_message, lazy.in_visible_message):
        error = g.check(text)
        if error is not None:
            raise bad_request(f"the strict tools cannot be enforced: {_plain(error)}",
                              code="unsupported_schema", param="tools")
    return lazy


_GRAMMAR_ECHO = re.compile(r"\d+ \| ")


def _plain(error: str, limit: int = 2000) -> str:
    """llguidance's error whole, on one line (a regex parse error spans several: the
    pattern, a caret under the fault, the reason), bounded."""
    lines = [line.strip() for line in error.strip().splitlines()]
    # "4 | answer_json: %json{...}": llguidance quotes the grammar it was given, the client's whole schema
    text = " ".join(line for line in lines if line and not _GRAMMAR_ECHO.match(line))
    text = text.split("failed to compile JSON schema: ", 1)[-1]
    return text if len(text) <= limit else text[:limit] + "..."

"""Constrained tool calls: the llguidance Lark rules of one ATEM tool message.

``call_grammar`` writes ``call_message`` (see
:class:`~musegl_core.plugins.specs.ToolParserSpec`): the header
`` to=ALIAS<|message|>`` and one ``<atem:function_calls>`` block with one
invoke of an allowed tool, whose parameters satisfy the tool's schema the
way :mod:`musegl_atem.coercion` reads them back:

* a parameter whose schema admits only strings is raw text (coercion keeps
  it verbatim): an ``enum``/``const`` of strings becomes those literals,
  ``minLength``/``maxLength`` bound its characters, and the text never
  contains ``</atem:parameter>``; a string carrying a Lark grammar
  (:data:`musegl_core.constrain.lark_embed.LARK_KEY`, a freeform tool's input)
  is a sentence of that grammar;
* any other parameter is JSON for its schema (llguidance's JSON-Schema
  compiler; the root's ``$defs``/``definitions`` travel with it), which
  coercion parses back;
* required parameters always appear, optional ones may, each once, in the
  declared order; no undeclared parameter is written.

Root schemas that are not a plain object (``anyOf`` at the root,
``patternProperties``, conditionals, ``minProperties`` ...), string
``pattern``\\s, and unions of strings with other types are refused with 400
``unsupported_schema``: what cannot be enforced is never left unconstrained.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from musegl_core.chat.tools import prompt_name
from musegl_core.constrain.grammar import json_rule, lark_string
from musegl_core.constrain.lark_embed import LARK_KEY, LarkEmbedError, embed_lark
from musegl_core.errors import ApiError

#: Root keywords a constrained tool schema may use.
_ROOT_KEYS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "description",
              "title", "$schema", "$id", "$comment", "examples", "default"}
#: Keywords of a string parameter written as raw text.
_STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength", "description", "title", "format", "examples",
                "default", "$comment", LARK_KEY}
CLOSE_PARAMETER = "</atem:parameter>\n"
_NO_CLOSE = r"~/(?s:.*<\/atem:parameter>.*)/"
OPEN_BLOCK = "<atem:function_calls>"
CLOSE_INVOKE = "</atem:invoke>"
CLOSE_BLOCK = "</atem:function_calls>"


def unsupported_schema(tool: str, message: str) -> ApiError:
    return ApiError(400, f"Tool {tool!r} cannot be constrained: {message}", "invalid_request_error",
                    "unsupported_schema", "tool_choice")


def _resolve(node: Any, root: Mapping[str, Any]) -> Any:
    ref = node.get("$ref") if isinstance(node, dict) else None
    for prefix, key in (("#/$defs/", "$defs"), ("#/definitions/", "definitions")):
        if isinstance(ref, str) and ref.startswith(prefix) and len(node) == 1:
            target = (root.get(key) or {}).get(ref[len(prefix):])
            if target is not None:
                return target
    return node


def _string_only(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "string":
        return True
    values = node.get("enum", [node["const"]] if "const" in node else None)
    return "type" not in node and bool(values) and all(isinstance(v, str) for v in values)


def _admits_string(node: Any) -> bool:
    if node is True or node == {}:
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind) or any(
        k in node for k in ("anyOf", "oneOf", "allOf", "$ref"))


def _string_value(tool: str, name: str, node: dict, rule: str) -> tuple[str, bool]:
    """The rules of a raw string value, and whether they include the closing tag."""
    extra = set(node) - _STRING_KEYS
    if extra:
        raise unsupported_schema(tool, f"parameter {name!r} uses {sorted(extra)[0]!r} on a string")
    if LARK_KEY in node:
        if set(node) - {"type", LARK_KEY, "description", "title", "$comment"}:
            raise unsupported_schema(tool, f"parameter {name!r} combines a grammar with other string keywords")
        try:
            rules, start = embed_lark(node[LARK_KEY], rule)
        except LarkEmbedError as error:
            raise unsupported_schema(tool, f"the grammar of parameter {name!r}: {error}") from None
        return f"{rule}: {start} {lark_string(CLOSE_PARAMETER)}\n" + rules, True
    values = node.get("enum", [node["const"]] if "const" in node else None)
    if values is not None:
        if not values or not all(isinstance(v, str) for v in values):
            raise unsupported_schema(tool, f"parameter {name!r} mixes strings with other values")
        return f"{rule}: " + " | ".join(lark_string(v) for v in values) + "\n", False
    low, high = node.get("minLength", 0), node.get("maxLength")
    span = f"{{{int(low)},{'' if high is None else int(high)}}}"
    # One lazy lexeme for the text *and* its closing tag, so it ends at the
    # first closing tag. (llguidance's lexemes are greedy otherwise: a value
    # lexeme followed by the tag as a second lexeme would take "</atem" as
    # value text and then refuse ":parameter".)
    return (f"{rule}[lazy]: {rule.upper()}\n{rule.upper()}: (/(?s:.{span})/ & {_NO_CLOSE}) "
            f"{lark_string(CLOSE_PARAMETER)}\n"), True


def _tool_rules(tool: str, alias: str, schema: Any, index: int, shared: dict[str, str] | None = None) -> str:
    """The rules of one tool's call. ``shared`` maps each JSON value grammar already written
    (``%json{...}``) to the rule that holds it: a parameter with the same schema refers to
    that rule instead of nesting the same grammar again (each nested grammar costs
    llguidance a lexer class, :data:`musegl_core.constrain.grammar.MAX_NESTED_WITH_TOKEN_BOUND`)."""
    if shared is None:
        shared = {}
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise unsupported_schema(tool, "its parameters must be an object schema")
    extra = {k for k in set(schema) - _ROOT_KEYS if not k.startswith("x-")}
    if extra:
        raise unsupported_schema(tool, f"the root keyword {sorted(extra)[0]!r} is not supported")
    properties = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise unsupported_schema(tool, "'properties' must be an object and 'required' an array")
    names = list(properties) + [r for r in required if r not in properties]
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    rules, parts = [], []
    for j, name in enumerate(names):
        if not isinstance(name, str) or not name or any(c in name for c in '"<>\r\n'):
            raise unsupported_schema(tool, f"the parameter name {name!r} cannot be written in ATEM")
        node = _resolve(properties.get(name, True), schema)
        value = f"v{index}_{j}"
        close = lark_string(CLOSE_PARAMETER)
        if _string_only(node):
            text, closed = _string_value(tool, name, node, value)
            rules.append(text)
            close = "" if closed else close
        elif isinstance(node, dict) and node and _admits_string(node) and not _untyped(node):
            raise unsupported_schema(tool, f"parameter {name!r} mixes strings with other types")
        else:
            body = {**node, **defs} if isinstance(node, dict) else node
            grammar = json_rule(body)
            if grammar not in shared:
                shared[grammar] = f"json{len(shared)}"
                rules.append(f"{shared[grammar]}: {grammar}\n")
            rules.append(f"{value}: {shared[grammar]}\n")
        param = f"p{index}_{j}"
        open_tag = lark_string('<atem:parameter name="' + name + '">')
        rules.append(f"{param}: {open_tag} {value} {close}\n")
        parts.append(param if name in required else f"{param}?")
    head = f" to={alias}"
    rules.insert(0, f"call{index}: {lark_string(head)} <|message|> {lark_string(OPEN_BLOCK + chr(10))} "
                    f"invoke{index} {lark_string(chr(10) + CLOSE_BLOCK)}\n")
    rules.insert(1, f"invoke{index}: {lark_string(_open_invoke(alias) + chr(10))} {' '.join(parts)} "
                    f"{lark_string(CLOSE_INVOKE)}\n")
    return "".join(rules)


def _open_invoke(alias: str) -> str:
    return f'<atem:invoke name="{alias}">'


def _untyped(node: dict) -> bool:
    return not any(k in node for k in ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"))


def _alias(tool: Any) -> str:
    alias = prompt_name(tool.name)
    if any(c in alias for c in '"<>\r\n'):
        raise unsupported_schema(tool.name, "its name cannot be written in ATEM")
    return alias


def call_grammar(tools: Iterable[Any], options: Mapping[str, Any]) -> Any:
    """``call_message`` and its rules for the tools named in ``options["names"]``;
    with ``options["lazy"]``, the lazily activated form (:func:`lazy_call_grammar`)."""
    if options.get("lazy"):
        return lazy_call_grammar(tools, options)
    allowed = set(options.get("names") or ())
    rules, alternatives, shared = [], [], {}
    for index, tool in enumerate(tools):
        if tool.name not in allowed:
            continue
        rules.append(_tool_rules(tool.name, _alias(tool), tool.parameters, index, shared))
        alternatives.append(f"call{index}")
    if not alternatives:
        raise ApiError(400, "no declared tool can be called", "invalid_request_error", param="tool_choice")
    return f"call_message: {' | '.join(alternatives)}\n" + "".join(rules)


def lazy_call_grammar(tools: Iterable[Any], options: Mapping[str, Any]) -> dict[str, str]:
    """The call grammar that starts once the model has written the block opener
    ``<atem:function_calls>`` (the trigger): ``lazy_call`` is the rest of the
    block, one invoke of a tool of ``options["names"]`` (``strict: true``)
    whose parameters satisfy its schema, then the closing tag and the core's
    ``lazy_end`` (what must follow the markup); or the opening tag of an
    invoke of a tool of ``options["free_names"]`` (not strict), after which
    the rule ends and the call is free text again."""
    strict = set(options.get("names") or ())
    free = set(options.get("free_names") or ())
    rules, alternatives, opens, shared = [], [], [], {}
    for index, tool in enumerate(tools):
        if tool.name in strict:
            rules.append(_tool_rules(tool.name, _alias(tool), tool.parameters, index, shared))
            alternatives.append(f"invoke{index}")
        elif tool.name in free:
            opens.append(lark_string(_open_invoke(_alias(tool))))
    if not alternatives:
        raise ApiError(400, "no declared tool can be called", "invalid_request_error", param="tools")
    body = f"lazy_call: {lark_string(chr(10))} (lazy_strict {lark_string(chr(10) + CLOSE_BLOCK)} lazy_end"
    body += f" | {' | '.join(opens)})\n" if opens else ")\n"
    return {"trigger": OPEN_BLOCK,
            "rules": body + f"lazy_strict: {' | '.join(alternatives)}\n" + "".join(rules)}


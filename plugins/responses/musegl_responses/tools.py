"""Responses tools → the core's tool definitions, and calls back to Responses items.

* ``function`` tools are function tools; ``namespace`` tools are flattened:
  each inner tool becomes ``<namespace>.<name>`` (the model's own
  ``namespace.function`` addressing), its description a namespace
  description of the template, and a call comes back as ``name`` +
  ``namespace``;
* ``custom`` (freeform) tools take one raw text: a function tool with a
  single string parameter ``input``. A ``grammar`` format (``lark``, or
  ``regex``) becomes the grammar of that string
  (:data:`musegl_core.constrain.lark_embed.LARK_KEY`) and the tool is
  constrained whenever it is called; a call comes back as a
  ``custom_tool_call`` with the raw ``input``;
* hosted tools (``web_search``, ``file_search``, ``mcp``, ...) are not run by
  musegl: they are left out of the prompt, and a ``tool_choice`` that
  requires one is a 400.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import attrs

from musegl_core.chat.messages import ToolDef
from musegl_core.constrain.lark_embed import LARK_KEY
from musegl_core.errors import bad_request, unsupported
from musegl_core.service.conversation import ToolChoice

log = logging.getLogger("musegl.responses")

#: keys of a function tool that change nothing here
_FUNCTION_KEYS = {"type", "name", "description", "parameters", "strict", "defer_loading", "output_schema",
                  "allowed_callers", "async"}
_CUSTOM_KEYS = {"type", "name", "description", "format", "defer_loading", "allowed_callers", "async"}


@attrs.frozen
class DeclaredTool:
    """How a prompt tool maps back: ``kind`` ``function`` | ``custom``, the
    client's ``name`` and ``namespace``."""

    kind: str
    name: str
    namespace: str | None = None


@attrs.frozen
class ToolSet:
    defs: tuple[ToolDef, ...] = ()
    declared: dict[str, DeclaredTool] = attrs.field(factory=dict)  # ToolDef name -> client tool
    hosted: tuple[str, ...] = ()  # hosted tool types declared (not served)
    namespace_descriptions: dict[str, str] = attrs.field(factory=dict)

    def call_item(self, call_name: str, call_id: str, arguments: str, item_id: str, status: str) -> dict[str, Any]:
        """The output item of a validated call."""
        declared = self.declared.get(call_name, DeclaredTool("function", call_name))
        if declared.kind == "custom":
            raw = json.loads(arguments).get("input", "")
            item = {"id": item_id, "type": "custom_tool_call", "status": status, "call_id": call_id,
                    "name": declared.name, "input": raw if isinstance(raw, str) else json.dumps(raw)}
        else:
            item = {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
                    "name": declared.name, "arguments": arguments}
        if declared.namespace is not None:
            item["namespace"] = declared.namespace
        return item


def _common(raw: dict, param: str, keys: set[str]) -> str:
    unknown = sorted(set(raw) - keys)
    if unknown:
        raise unsupported(f"{param}.{unknown[0]}", f"unknown key {unknown[0]!r} in '{param}'")
    name = raw.get("name")
    if not isinstance(name, str) or not name or "." in name:
        raise bad_request(f"'{param}.name' must be a non-empty string without dots", param=f"{param}.name")
    if raw.get("async"):
        raise unsupported(f"{param}.async", "asynchronous tool calls are not supported")
    callers = raw.get("allowed_callers")
    if callers is not None and (not isinstance(callers, list) or any(c != "direct" for c in callers) or not callers):
        raise unsupported(f"{param}.allowed_callers", "only direct tool calls exist here: allowed_callers must be [\"direct\"]")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{param}.description' must be a string", param=f"{param}.description")
    return name


def _function(raw: dict, param: str, namespace: str | None) -> tuple[ToolDef, DeclaredTool]:
    name = _common(raw, param, _FUNCTION_KEYS)
    parameters = raw.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"'{param}.parameters' must be a JSON Schema object", param=f"{param}.parameters")
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{param}.strict' must be a boolean", param=f"{param}.strict")
    full = f"{namespace}.{name}" if namespace else name
    return (ToolDef(full, raw.get("description"), parameters or {"type": "object", "properties": {}}, strict),
            DeclaredTool("function", name, namespace))


def custom_grammar(fmt: Any, param: str) -> str | None:
    """The Lark grammar of a custom tool's ``format`` (None: free text)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"'{param}' must be an object", param=param)
    kind = fmt.get("type")
    if kind == "text":
        if set(fmt) - {"type"}:
            raise unsupported(f"{param}.{sorted(set(fmt) - {'type'})[0]}", "a text format takes no other keys")
        return None
    if kind != "grammar":
        raise bad_request(f"'{param}.type' must be 'text' or 'grammar'", param=f"{param}.type")
    unknown = set(fmt) - {"type", "syntax", "definition"}
    if unknown:
        raise unsupported(f"{param}.{sorted(unknown)[0]}", f"unknown key {sorted(unknown)[0]!r} in '{param}'")
    definition = fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise bad_request(f"'{param}.definition' must be a non-empty grammar", param=f"{param}.definition")
    syntax = fmt.get("syntax")
    if syntax == "lark":
        return definition
    if syntax == "regex":
        return "start: /" + definition.replace("\\/", "/").replace("/", "\\/") + "/\n"
    raise bad_request(f"'{param}.syntax' must be 'lark' or 'regex'", param=f"{param}.syntax")


def _custom(raw: dict, param: str, namespace: str | None) -> tuple[ToolDef, DeclaredTool]:
    name = _common(raw, param, _CUSTOM_KEYS)
    grammar = custom_grammar(raw.get("format"), f"{param}.format")
    value: dict[str, Any] = {"type": "string"}
    if grammar is not None:
        value[LARK_KEY] = grammar
    schema = {"type": "object", "properties": {"input": value}, "required": ["input"], "additionalProperties": False}
    full = f"{namespace}.{name}" if namespace else name
    return ToolDef(full, raw.get("description"), schema, grammar is not None), DeclaredTool("custom", name, namespace)


def parse_tools(raw: Any) -> ToolSet:
    """The request's ``tools``; errors name ``tools[i]``."""
    if raw is None:
        return ToolSet()
    defs, declared, hosted, descriptions = [], {}, [], {}

    def add(pair: tuple[ToolDef, DeclaredTool], param: str) -> None:
        if pair[0].name in declared:
            raise bad_request(f"the tool {pair[0].name!r} is declared twice", code="invalid_tool_schema", param=param)
        defs.append(pair[0])
        declared[pair[0].name] = pair[1]

    for index, tool in enumerate(raw):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise bad_request(f"'{param}' must be an object", param=param)
        kind = tool.get("type")
        if kind == "function":
            add(_function(tool, param, None), param)
        elif kind == "custom":
            add(_custom(tool, param, None), param)
        elif kind == "namespace":
            unknown = set(tool) - {"type", "name", "description", "tools"}
            if unknown:
                raise unsupported(f"{param}.{sorted(unknown)[0]}", f"unknown key {sorted(unknown)[0]!r} in '{param}'")
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace or "." in namespace:
                raise bad_request(f"'{param}.name' must be a non-empty string without dots", param=f"{param}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise bad_request(f"'{param}.tools' must be a non-empty array", param=f"{param}.tools")
            if isinstance(tool.get("description"), str):
                descriptions[namespace] = tool["description"]
            for j, item in enumerate(inner):
                item_param = f"{param}.tools[{j}]"
                if not isinstance(item, dict) or item.get("type") not in ("function", "custom"):
                    raise bad_request(f"'{item_param}' must be a function or custom tool", param=f"{item_param}.type")
                parse = _function if item["type"] == "function" else _custom
                add(parse(item, item_param, namespace), item_param)
        elif isinstance(kind, str) and kind:
            log.info("responses: the hosted tool %.100r is not run by musegl; left out of the prompt", kind)
            hosted.append(kind)
        else:
            raise bad_request(f"'{param}.type' must be a string", param=f"{param}.type")
    return ToolSet(tuple(defs), declared, tuple(hosted), descriptions)


def _find(tools: ToolSet, name: Any, kind: str, param: str, namespace: Any = None) -> str:
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{param}.name' must be a non-empty string", param=f"{param}.name")
    for full, declared in tools.declared.items():
        if declared.name == name and declared.kind == kind and (namespace is None or declared.namespace == namespace):
            return full
        if full == name and declared.kind == kind:
            return full
    raise bad_request(f"tool_choice names the {kind} tool {name!r}, which is not among the declared tools",
                      param=f"{param}.name")


def tool_choice(raw: Any, tools: ToolSet, parallel: bool) -> tuple[ToolChoice, ToolSet]:
    """The core's tool choice, and the tools it leaves in the prompt (``allowed_tools`` narrows them)."""
    param = "tool_choice"
    if raw is None or raw in ("auto", "none", "required"):
        mode = raw or "auto"
        if mode == "required" and not tools.defs:
            what = f" (the hosted tools {', '.join(tools.hosted)} are not run here)" if tools.hosted else ""
            raise unsupported(param, f"tool_choice 'required' needs a function or custom tool{what}")
        return ToolChoice(mode, None, parallel=parallel), tools
    if not isinstance(raw, dict):
        raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or an object", param=param)
    kind = raw.get("type")
    if kind in ("function", "custom"):
        full = _find(tools, raw.get("name"), kind, param, raw.get("namespace"))
        return ToolChoice("named", full, parallel=parallel), tools
    if kind == "allowed_tools":
        mode = raw.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request("'tool_choice.mode' must be 'auto' or 'required'", param=f"{param}.mode")
        listed = raw.get("tools")
        if not isinstance(listed, list) or not listed:
            raise bad_request("'tool_choice.tools' must be a non-empty array", param=f"{param}.tools")
        keep = []
        for index, item in enumerate(listed):
            item_param = f"{param}.tools[{index}]"
            if not isinstance(item, dict) or item.get("type") not in ("function", "custom"):
                kind_name = item.get("type") if isinstance(item, dict) else None
                raise unsupported(item_param, f"the tool {kind_name!r} is not run by musegl; only function and "
                                              "custom tools can be allowed")
            keep.append(_find(tools, item.get("name"), item["type"], item_param, item.get("namespace")))
        narrowed = attrs.evolve(tools, defs=tuple(d for d in tools.defs if d.name in keep))
        return ToolChoice(mode, None, parallel=parallel), narrowed
    if isinstance(kind, str):
        raise unsupported(param, f"tool_choice requires the hosted tool {kind!r}, which musegl does not run")
    raise bad_request("'tool_choice.type' must be a string", param=f"{param}.type")

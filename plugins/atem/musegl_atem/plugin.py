"""Hook implementations of the musegl-atem plugin (entry point ``atem``).

Registers the ``atem`` tool parser, selected with
``musegl serve --tool-parser atem``. Importing this module imports nothing
heavy: the parser and the validators load when a request first needs them.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import ToolParserSpec


def _prepare(tools: list[Any]) -> Any:
    from musegl_atem.calls import prepare

    return prepare(tools)


def _create(tools: Iterable[Any], options: Mapping[str, Any]) -> Any:
    from musegl_atem.calls import create

    return create(tools, options)


def _grammar(tools: Iterable[Any], options: Mapping[str, Any]) -> Any:
    from musegl_atem.grammar import call_grammar

    return call_grammar(tools, options)


@hookimpl
def musegl_tool_parsers() -> list[ToolParserSpec]:
    return [
        ToolParserSpec(
            name="atem",
            description="ATEM tool calls (<atem:function_calls>) with JSON-Schema validation and coercion",
            create=_create,
            prepare=_prepare,
            grammar=_grammar,
        )
    ]

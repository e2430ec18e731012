"""Helpers shared by the musegl-atem tests: run model output through the real
channel parser and the ATEM parser, as the front does."""

from __future__ import annotations

from typing import Any

from musegl_core.chat import channels
from musegl_core.chat.messages import ToolDef
from musegl_core.chat.tools import tool_aliases
from musegl_core.errors import ApiError

from musegl_atem.calls import create, prepare

FORECAST = ToolDef(
    "weather.get_forecast",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
)
GET_TIME = ToolDef("get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})


def block(name: str, params: list[tuple[str, str]]) -> str:
    """One ATEM block invoking ``name`` with raw parameter bodies."""
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in params)
    return f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'


def call(name: str, params: list[tuple[str, str]]) -> str:
    """A tool-addressed message carrying one block."""
    return f" to={name}<|message|>{block(name, params)}<|eot|>"


def run(output: str, tools: list[ToolDef], end: str = "eos", chunk: int | None = None) -> Any:
    """Parse ``output``; returns ``[(name, arguments), ...]`` or the ApiError."""
    parser = create(tools, {"aliases": tool_aliases(t.name for t in tools), "prepared": prepare(tools)})
    channel = channels.ChannelParser(tools_active=True)
    pieces = [output] if chunk is None else [output[i : i + chunk] for i in range(0, len(output), chunk)]
    for piece in pieces:
        for event in channel.feed(piece):
            if isinstance(event, (channels.ToolDelta, channels.ToolMessageEnd)):
                parser.feed(event)
    for event in channel.finish(end):
        if isinstance(event, (channels.ToolDelta, channels.ToolMessageEnd)):
            parser.feed(event, at_end=True)
    try:
        return [(c.name, c.arguments) for c in parser.finish(end)]
    except ApiError as error:
        return error


def args(tool: ToolDef, params: list[tuple[str, str]]) -> Any:
    """The coerced arguments of one call of ``tool`` (or the ApiError)."""
    result = run(call(tool.name if "." in tool.name else f"{tool.name}.{tool.name}", params), [tool])
    return result if isinstance(result, ApiError) else result[0][1]


def schema_error(tools: list[ToolDef]) -> ApiError | None:
    try:
        prepare(tools)
    except ApiError as error:
        return error
    return None


def is_output_error(result: Any) -> bool:
    return isinstance(result, ApiError) and result.status == 502 and result.code == "invalid_tool_output"

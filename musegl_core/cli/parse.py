"""Print the response fields the server would return for raw generated text.

Reads raw model output with special tokens written out (a file, or
``-``/nothing for stdin), for example
``" to=self<|message|>Add.<|eom|><|start|>assistant to=user<|message|>4<|eot|>"``,
and prints ``reasoning_content``, ``content``, ``tool_calls`` and
``finish_reason`` as the server would answer (docs/protocol.md, part 2).

It runs the server's own code: the request options come from ``--request``
(a chat-completions body, validated as the front does) or from the flags; the
text goes through the worker's end-of-generation and stop-string handling
(``<|eot|>`` and ``<|end_of_text|>`` end generation unless ``--ignore-eos``;
``--stop`` strings are cut as request stops), then through the front's
response assembly (channel parser, tool parser, finish reason). Tool calls
need a tool-parser plugin (``atem``, through the plugin manager); with tools
active, the tool-addressed messages the channel parser handed off are shown
as ``tool_messages`` either way.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from musegl_core.chat import channels
from musegl_core.cli.main import OneLineParser
from musegl_core.cli.render import load_plugins, read_input, render_request, report_error
from musegl_core.engine.stops import StopMatcher
from musegl_core.errors import ApiError, ConfigError
from musegl_core.http import schemas as s
from musegl_core.openai.chat import ResponseAssembler
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker import messages as m

#: The written-out tokens that end generation (tokenizer.end_of_generation_ids).
END_OF_GENERATION = ("<|eot|>", "<|end_of_text|>")
_PLACEHOLDER_MESSAGES = [{"role": "user", "content": "(musegl parse)"}]


@attrs.frozen
class ParseOptions:
    """How the text was generated: the request and the way generation ended."""

    request: dict[str, Any] = attrs.field(factory=lambda: {"messages": _PLACEHOLDER_MESSAGES})
    tools_active: bool = False
    tool_parser: str | None = None
    finish: str = "eos"  # eos | length: how generation ended when no stop matched
    dialect: str = "openai"


def worker_output(text: str, stops: tuple[str, ...], *, ignore_eos: bool, finish: str) -> tuple[str, m.Done]:
    """The text and ``Done`` event the worker would report for raw output
    ``text``: cut at the first end-of-generation token (unless ``ignore_eos``),
    then at the first request stop."""
    ended = False
    if not ignore_eos:
        cuts = [text.find(token) for token in END_OF_GENERATION if token in text]
        if cuts:
            text, ended = text[: min(cuts)], True
    matcher = StopMatcher(stops)
    emitted, matched = matcher.push(text)
    if matched is None:
        emitted += matcher.flush()
        matched = matcher.matched
    reason = "stop" if matched is not None or ended or finish == "eos" else "length"
    return emitted, m.Done("parse", reason, matched, 0, 0)


def parse_text(text: str, options: ParseOptions, plugins: PluginManager) -> dict[str, Any]:
    """The response fields for ``text``; raises :class:`ApiError` where the
    server answers with an error (a 400 for the request, a 502
    ``invalid_tool_output`` for the text)."""
    request = dict(options.request)
    parser_name = options.tool_parser
    if parser_name is None and request.get("tools") and "atem" in plugins.specs("tool_parsers"):
        parser_name = "atem"
    declared = bool(request.get("tools")) and request.get("tool_choice") != "none"
    if parser_name is None:  # no tool parser: show the tool messages, without calls
        request.pop("tools", None)
    rendered = render_request(
        json.dumps(request), plugins=plugins, tool_parser=parser_name, api_dialect=options.dialect
    )
    plan = rendered.plan
    if options.tools_active or (declared and parser_name is None):
        plan = attrs.evolve(plan, tools_active=True)
    tool_parser = plugins.get("tool_parsers", parser_name) if parser_name and plan.tools_active else None
    dialect = plugins.get("dialects", options.dialect).create()

    output, done = worker_output(
        text, plan.generate.stop, ignore_eos=plan.ignore_eos, finish=options.finish
    )
    assembler = ResponseAssembler(plan, tool_parser)
    assembler.feed(m.Tokens("parse", (), output))
    _, reason = assembler.finish(done)
    result = s.to_json(assembler.message(dialect))
    result.pop("role", None)
    result["finish_reason"] = reason
    if plan.tools_active:
        end = channels.ChannelParser(tools_active=True)
        events = end.feed(output) + end.finish(_end_kind(done))
        result["tool_messages"] = [attrs.asdict(message) for message in channels.collect(events).tool_messages]
    return result


def _end_kind(done: m.Done) -> str:
    if done.finish_reason == "length":
        return "length"
    return "stop" if done.matched_stop is not None else "eos"


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="musegl parse", description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?", help="raw generated text (file); - or omitted: stdin")
    p.add_argument("--request", metavar="FILE", help="the chat-completions body the text answers (tools, "
                   "reasoning visibility, stop strings)")
    p.add_argument("--tools", metavar="JSON", help="the request's tools: a JSON array, or @FILE")
    p.add_argument("--tools-active", action="store_true",
                   help="treat tool-addressed messages as tool messages even without declared tools")
    p.add_argument("--tool-parser", metavar="NAME", help="tool-call parser (default: atem when installed)")
    p.add_argument("--hide-reasoning", action="store_true", help="as include_reasoning: false")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="request stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not end generation at <|eot|>/<|end_of_text|>")
    p.add_argument("--finish", choices=("eos", "length"), default="eos",
                   help="how generation ended when no stop matched (default: eos)")
    p.add_argument("--api-dialect", default="openai", metavar="NAME")
    p.add_argument("--plugin", action="append", dest="plugins", metavar="NAME",
                   help="load only these plugins (repeatable; default: every installed one)")
    args = p.parse_args(argv)

    text = read_input(args.output)
    request = json.loads(read_input(args.request)) if args.request else {"messages": _PLACEHOLDER_MESSAGES}
    if not isinstance(request, dict):
        raise ConfigError("--request must hold a JSON object")
    request.setdefault("messages", _PLACEHOLDER_MESSAGES)
    if args.tools:
        source = read_input(args.tools[1:]) if args.tools.startswith("@") else args.tools
        try:
            request["tools"] = json.loads(source)
        except ValueError as exc:
            raise ConfigError(f"--tools is not valid JSON: {exc}") from exc
    if args.hide_reasoning:
        request["include_reasoning"] = False
    if args.stop:
        request["stop"] = args.stop
    if args.ignore_eos:
        request["ignore_eos"] = True
    options = ParseOptions(
        request=request,
        tools_active=args.tools_active,
        tool_parser=args.tool_parser,
        finish=args.finish,
        dialect=args.api_dialect,
    )
    try:
        result = parse_text(text, options, load_plugins(args.plugins))
    except ApiError as error:
        return report_error(error)
    print(json.dumps(result, ensure_ascii=False, indent=2))
    return 0

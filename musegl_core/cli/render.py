"""Print the exact prompt a chat-completions request becomes (and its token ids).

Reads a ``POST /v1/chat/completions`` body (a file, or ``-``/nothing for
stdin) and runs it through the server's own front code: body parsing, field
validation, the reject list, reasoning and template options, tool checks and
the chat template (:func:`musegl_core.openai.chat.plan_chat`). A request
the server would refuse is refused here with the same error object (exit 1).
With ``--ids`` the prompt is tokenized the way the worker does it
(:func:`musegl_core.worker.prepare.prepare`), with the served tokenizer
(``--model``), a tokenizer file (``--tokenizer``) or the demo checkpoint's.

Meant for users checking what the model sees, and for plugin authors
checking a template or dialect against docs/protocol.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import attrs

from musegl_core.cli.main import OneLineParser
from musegl_core.config import ServeConfig
from musegl_core.errors import ApiError, ConfigError
from musegl_core.http import schemas as s
from musegl_core.openai.schemas import structure_request
from musegl_core.openai.chat import ChatPlan, plan_chat
from musegl_core.plugins.manager import PluginManager
from musegl_core.worker import messages as m


@attrs.frozen
class RenderedRequest:
    """What ``musegl render`` shows: the plan's prompt segments, their text, and
    (when asked) the prompt's token ids."""

    plan: ChatPlan
    text: str
    ids: tuple[int, ...] | None = None


def read_input(source: str | None, stdin: TextIO | None = None) -> str:
    """The text of ``source`` (a path), or of stdin for ``None``/``-``."""
    if source is None or source == "-":
        return (stdin or sys.stdin).read()
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc.strerror or exc}") from exc


def load_plugins(names: list[str] | None) -> PluginManager:
    """The plugins to use: the named ones (``--plugin``), or every installed one."""
    return PluginManager(only=names)


def render_request(
    body: bytes | str,
    *,
    plugins: PluginManager,
    template: str = "muse",
    tool_parser: str | None = None,
    api_dialect: str = "openai",
    session_header: str | None = None,
    tokenizer: Any = None,
    max_vision_patches: int = 4096,
) -> RenderedRequest:
    """Validate and render a request body exactly as the front does (the steps
    of ``chat_completions`` in :mod:`musegl_core.http.app`: body, dialect
    extensions, type checks, planning).

    :raises ApiError: the 400 the server would answer.
    """
    config = ServeConfig(template=template, tool_parser=tool_parser, api_dialect=api_dialect)
    dialect = plugins.get("dialects", api_dialect).create()
    payload = dialect.adapt_request(s.parse_body(body.encode() if isinstance(body, str) else body))
    request = structure_request(payload)
    plan = plan_chat(
        request,
        request_id="render",
        config=config,
        template=plugins.get("templates", template).create(),
        tool_parser=plugins.get("tool_parsers", tool_parser) if tool_parser else None,
        header_session_id=session_header,
    )
    text = "".join(segment.text or "" for segment in plan.generate.prompt)
    ids = None
    if tokenizer is not None:
        from musegl_core.vision.preprocess import ImagePreprocessor
        from musegl_core.worker.prepare import prepare

        ids = prepare(plan.generate, tokenizer, vision=ImagePreprocessor(max_vision_patches)).prompt_ids
    return RenderedRequest(plan=plan, text=text, ids=ids)


def load_tokenizer(model: str | None, tokenizer: str | None) -> Any:
    """The tokenizer of ``--tokenizer`` / ``--model``, else the demo checkpoint's."""
    from musegl_core.model_tokenizer import load_tokenizer as load_model_tokenizer
    from musegl_core.tokenizer import TokenizerError

    path = tokenizer or model
    if path is None:
        from musegl_core.tiny import default_model_path

        path = str(default_model_path(progress=True))
    try:
        return load_model_tokenizer(path)
    except (OSError, ValueError, TokenizerError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path}: {exc}") from exc


def report_error(error: ApiError) -> int:
    """Print the error object the server would send (openai shape, plus the
    HTTP status) to stderr; returns the exit status 1."""
    body = s.to_json(s.ErrorBody(s.ErrorObject(error.message, error.type, error.param, error.code)))
    print(json.dumps({"status": error.status, **body}, ensure_ascii=False), file=sys.stderr)
    return 1


def _segments_json(plan: ChatPlan) -> list[dict[str, Any]]:
    return [m.converter.unstructure(segment) for segment in plan.generate.prompt]


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="musegl render", description=__doc__.split("\n\n")[0])
    p.add_argument("request", nargs="?", help="chat-completions request body (JSON file); - or omitted: stdin")
    p.add_argument("--ids", action="store_true", help="also print the prompt's token ids")
    p.add_argument("--model", metavar="PATH", help="checkpoint whose tokenizer --ids uses (GGUF or HF directory)")
    p.add_argument("--tokenizer", metavar="PATH", help="tokenizer for --ids: tokenizer.json, HF directory or GGUF")
    p.add_argument("--tool-parser", metavar="NAME", help="as musegl serve --tool-parser (needed for tools)")
    p.add_argument("--template", default="muse", metavar="NAME", help="chat template (default: muse)")
    p.add_argument("--api-dialect", default="openai", metavar="NAME", help="as musegl serve --api-dialect")
    p.add_argument("--session-id", metavar="ID", help="as the X-Session-Id header")
    p.add_argument("--plugin", action="append", dest="plugins", metavar="NAME",
                   help="load only these plugins (repeatable; default: every installed one)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, segments, ids)")
    p.add_argument("--max-vision-patches", type=int, default=4096, metavar="N",
                   help="as musegl serve --max-vision-patches: how --ids expands an image (default %(default)s)")
    args = p.parse_args(argv)

    body = read_input(args.request)
    plugins = load_plugins(args.plugins)
    tokenizer = load_tokenizer(args.model, args.tokenizer) if args.ids else None
    try:
        rendered = render_request(
            body,
            plugins=plugins,
            template=args.template,
            tool_parser=args.tool_parser,
            api_dialect=args.api_dialect,
            session_header=args.session_id,
            tokenizer=tokenizer,
            max_vision_patches=args.max_vision_patches,
        )
    except ApiError as error:
        return report_error(error)
    if args.json:
        payload: dict[str, Any] = {"prompt": rendered.text, "segments": _segments_json(rendered.plan)}
        if rendered.ids is not None:
            payload["ids"] = list(rendered.ids)
        print(json.dumps(payload, ensure_ascii=False))
        return 0
    sys.stdout.write(rendered.text + "\n")
    if rendered.ids is not None:
        print(f"\n# {len(rendered.ids)} token ids")
        print(" ".join(map(str, rendered.ids)))
    return 0

"""The per-request ATEM tool parser: from channel events to validated tool calls.

:func:`prepare` runs in preflight and compiles every active tool once
(:class:`PreparedTools`). :class:`AtemToolParser` is created per request,
receives the channel parser's tool events while the model generates, and at
the end of generation returns the validated call set, an empty set when the
call set was cut off (``length`` or a request ``stop``), or raises 502
``invalid_tool_output``.
"""

from __future__ import annotations

import collections
import json
import threading
import uuid
from typing import Any, Iterable, Mapping

import attrs

from musegl_core.chat import channels
from musegl_core.chat.tools import resolve_tool_name, tool_aliases
from musegl_core.errors import ApiError

from musegl_atem.budget import BudgetExhausted, OutputBudget, RegexBudget
from musegl_atem.coercion import CoercionFailed, coerce_arguments
from musegl_atem.parser import Invoke, scan_piece
from musegl_atem.schemas import CompiledTool, compile_tools
from musegl_atem.validate import ToolValidator, ValidationRun, validation_run

#: Declared order is kept in :attr:`PreparedTools.tools`.


def invalid_tool_output(message: str) -> ApiError:
    """The 502 ``invalid_tool_output`` error."""
    return ApiError(502, f"The model produced an invalid tool call: {message}", "server_error", "invalid_tool_output")


@attrs.frozen
class PreparedTools:
    """The active tools of one request after preflight, keyed by declared name."""

    tools: dict[str, CompiledTool]
    validators: dict[str, ToolValidator]
    patterns: dict[str, Any]


#: Tool sets whose compiled form is kept (least recently used out first): an agent sends the
#: same tools with every turn, and compiling ten tool schemas costs milliseconds of the front's
#: event loop per request.
PREPARED_KEPT = 64
_kept: collections.OrderedDict[str, PreparedTools] = collections.OrderedDict()
_kept_lock = threading.Lock()


def _tools_key(tools: list[Any]) -> str | None:
    """The identity of a tool set: every declared field, in order (None: not JSON, not kept)."""
    try:
        return json.dumps([[t.name, t.description, t.parameters, t.strict] for t in tools], ensure_ascii=False,
                          separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # (a schema nested past the encoder's depth)
        return None


def prepare(tools: list[Any]) -> PreparedTools:
    """Preflight the active tools (``ToolDef`` objects); raises ApiError 400.

    Schemas are compiled here, once per tool set: the parser created for the
    request reuses them, and so does every later request that declares the
    same tools (the last :data:`PREPARED_KEPT` sets are kept; what is kept is
    only read: each validation run takes its own budgets and pattern table).
    A tool set that fails preflight is not kept.
    """
    key = _tools_key(tools)
    if key is not None:
        with _kept_lock:
            kept = _kept.get(key)
            if kept is not None:
                _kept.move_to_end(key)
                return kept
    prepared = _compile(tools)
    if key is not None:
        with _kept_lock:
            _kept[key] = prepared
            while len(_kept) > PREPARED_KEPT:
                _kept.popitem(last=False)
    return prepared


def _compile(tools: list[Any]) -> PreparedTools:
    compiled = compile_tools(tools)
    patterns: dict[str, Any] = {}
    for tool in compiled:
        patterns.update(tool.patterns)
    return PreparedTools(
        {tool.name: tool for tool in compiled},
        {tool.name: ToolValidator.build(tool) for tool in compiled},
        patterns,
    )


@attrs.frozen
class ToolCall:
    """A validated call: ``arguments`` is the JSON object as a string."""

    id: str
    name: str
    arguments: dict


@attrs.define
class _Piece:
    """One tool message or intent block as the channel parser hands it over."""

    intent: bool
    chunks: list[str] = attrs.Factory(list)
    ended: bool = False
    closed: bool = False
    broke_off: bool = False


class AtemToolParser:
    """Collects one response's tool text and validates its call set.

    ``feed(event, at_end=False)`` takes the channel parser's
    :class:`~musegl_core.chat.channels.ToolDelta` and
    :class:`~musegl_core.chat.channels.ToolMessageEnd` events in order;
    ``at_end`` is true for the events ``ChannelParser.finish`` settled. Text is
    only appended (linear in the output); it is read once, when its piece
    ends. ``finish(end)`` returns the calls or raises ApiError 502.
    """

    def __init__(self, prepared: PreparedTools, aliases: Mapping[str, str]):
        self.prepared = prepared
        self.aliases = dict(aliases)
        self.pieces: list[_Piece] = []

    def feed(self, event: Any, at_end: bool = False) -> None:
        """Take one tool event of the channel parser."""
        if isinstance(event, channels.ToolDelta):
            piece = self.pieces[-1] if self.pieces and not self.pieces[-1].ended else None
            if piece is None or piece.intent != event.intent:
                piece = _Piece(event.intent)
                self.pieces.append(piece)
            piece.chunks.append(event.text)
        elif isinstance(event, channels.ToolMessageEnd):
            piece = self.pieces[-1] if self.pieces and not self.pieces[-1].ended else None
            if piece is None:  # a tool message without any body text
                piece = _Piece(event.intent)
                self.pieces.append(piece)
            piece.ended = True
            piece.closed = event.complete
            # An intent block that ends open before the output did broke off
            # at a deviation the channel parser saw (a malformed block).
            piece.broke_off = event.intent and not event.complete and not at_end

    def finish(self, end: str) -> list[ToolCall]:
        """Validate the call set at the end of generation (``end``: ``eos``,
        ``length``, ``stop`` or ``cancel``)."""
        invokes: list[Invoke] = []
        truncated = False
        for piece in self.pieces:
            scanned = scan_piece("".join(piece.chunks), message=not piece.intent, closed=piece.closed or piece.broke_off)
            if scanned.status == "malformed":
                raise invalid_tool_output(scanned.problem)
            if scanned.status == "incomplete":
                truncated = True
            invokes.extend(scanned.invokes)
        names = [self._declared_name(invoke) for invoke in invokes]
        if truncated:
            if end == "eos":
                raise invalid_tool_output("the output ended inside a tool call")
            return []  # the whole call set is suppressed (length / stop / cancel)
        run = ValidationRun(OutputBudget(), RegexBudget(), dict(self.prepared.patterns))
        calls = []
        with validation_run(run):
            for invoke, name in zip(invokes, names):
                try:
                    arguments = coerce_arguments(
                        invoke, self.prepared.tools[name], self.prepared.validators[name], run
                    )
                except (CoercionFailed, BudgetExhausted) as exc:
                    raise invalid_tool_output(str(exc)) from None
                calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments))
        return calls

    def _declared_name(self, invoke: Invoke) -> str:
        name = resolve_tool_name(invoke.name, self.aliases)
        if name is None or name not in self.prepared.tools:
            raise invalid_tool_output(f"the model called {invoke.name!r}, which is not a declared tool")
        return name


def create(tools: Iterable[Any], options: Mapping[str, Any]) -> AtemToolParser:
    """The parser of one request (``ToolParserSpec.create``).

    ``options["prepared"]`` is what :func:`prepare` returned for these tools
    in preflight (compiled again only when absent); ``options["aliases"]``
    maps prompt names to declared names.
    """
    tools = list(tools)
    prepared = options.get("prepared") or prepare(tools)
    aliases = options.get("aliases") or tool_aliases(tool.name for tool in tools)
    return AtemToolParser(prepared, aliases)

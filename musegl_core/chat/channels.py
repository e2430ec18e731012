'''The channel parser: model output → reasoning, content and tool messages.

Implements the output grammar (everything that does not
need a tool parser). The model's output is a sequence of messages
``[<|start|>assistant][ to=R]<|message|>body<|eom|>``; the parser scans it left
to right and emits events:

* :class:`ReasoningDelta` — text of ``to=self`` messages (``reasoning_content``);
  none at all when ``hide_reasoning`` is set;
* :class:`ContentDelta` — text of visible messages (``content``); the ``"\\n\\n"``
  separator between two bodies is part of the delta that starts the second;
* :class:`ToolDelta` / :class:`ToolMessageEnd` — the hand-off to a tool-call
  parser (ATEM), only while tools are active. Two kinds of text are handed off:
  the body of a tool-addressed message (``intent=False``: everything between
  its header and its structural terminator, whitespace included), and a
  line-start ``<atem:function_calls>`` block inside a visible message
  (``intent=True``: exactly the block text). ``ToolDelta`` events carry the
  raw text in order; ``ToolMessageEnd`` closes the piece, with
  ``complete=True`` when it ended at its delimiter (terminator or closing tag)
  and ``False`` when the output ended first or an intent block broke off
  (the tool parser then finds it incomplete or malformed). A tool parser
  implementing :class:`musegl_core.plugins.specs.ToolParserSpec` receives
  ``feed(recipient, text)`` for each ``ToolDelta``.

The parser understands just enough ATEM (:class:`AtemBlockScanner`) to keep
parameter values opaque: a terminator or header inside a value never ends a
message, with or without tools.

Streaming and buffered parsing agree for every chunking of the text:
:func:`parse_output` is ``feed(text)`` + ``finish(end)``. The parser holds back
only what is still ambiguous (a ``<|`` control-token prefix, a possible header
after a terminator, an incomplete ``<|start|>`` header, a possible
``<atem:function_calls>`` opener at a visible line start). It works on
characters: the detokenizer upstream emits only complete UTF-8 characters, so
splits inside a multi-byte character never reach it.
'''

from __future__ import annotations

import bisect
import re
from typing import Literal, Union

import attrs

START = "<|start|>"
MESSAGE = "<|message|>"
EOM = "<|eom|>"
EOT = "<|eot|>"
TERMINATORS = (EOM, EOT)
#: Known control tokens.
CONTROL_TOKENS = (START, MESSAGE, EOM, EOT, "<|begin_of_text|>", "<|end_of_text|>")
ATEM_OPEN = "<atem:function_calls>"
ATEM_CLOSE = "</atem:function_calls>"
_INVOKE_OPEN = '<atem:invoke name="'
_INVOKE_CLOSE = "</atem:invoke>"
_PARAM_OPEN = '<atem:parameter name="'
_PARAM_CLOSE = "</atem:parameter>"

EndReason = Literal["eos", "length", "stop", "cancel"]
END_REASONS = ("eos", "length", "stop", "cancel")

_WS = " \t\r\n"
_RECIPIENT = re.compile(r"[A-Za-z0-9_.\-]*")
_ATEM_NAME = re.compile(r'[^"<>\r\n]*')
_PLAIN = re.compile(r"[<\n]")
_TOOL_PLAIN = re.compile(r"[<" + _WS + r"]")
_NOT_WS = re.compile(r"[^ \t\r\n]")
_WS_RUN = re.compile(r"[ \t\r\n]*")

# -- events -------------------------------------------------------------------------


@attrs.frozen
class ReasoningDelta:
    """Reasoning text (``reasoning_content``)."""

    text: str


@attrs.frozen
class ContentDelta:
    """Visible text (``content``)."""

    text: str


@attrs.frozen
class ToolDelta:
    """Raw text for the tool parser, in output order.

    ``recipient`` is the header's recipient (for an intent block, the visible
    message's recipient, normally ``user``); ``intent`` marks a block found in
    a visible message."""

    recipient: str
    text: str
    intent: bool = False


@attrs.frozen
class ToolMessageEnd:
    """The end of a tool-addressed message or of an intent block."""

    recipient: str
    complete: bool
    intent: bool = False


ChannelEvent = Union[ReasoningDelta, ContentDelta, ToolDelta, ToolMessageEnd]


@attrs.frozen
class ToolMessage:
    """A tool-addressed message or intent block, assembled (buffered parsing)."""

    recipient: str
    body: str
    complete: bool
    intent: bool = False


@attrs.frozen
class ParsedOutput:
    """The buffered result: ``reasoning``/``content`` are ``None`` when empty."""

    reasoning: str | None
    content: str | None
    tool_messages: tuple[ToolMessage, ...]


# -- matching helpers -------------------------------------------------------------

_FULL, _PARTIAL, _NONE = "full", "partial", "none"


def _literal(buf: str, pos: int, lit: str) -> str:
    """Does ``buf[pos:]`` start with ``lit`` (full), end inside it (partial), or not?"""
    if buf.startswith(lit, pos):
        return _FULL
    rest = buf[pos : pos + len(lit)]
    return _PARTIAL if lit.startswith(rest) else _NONE


def match_header(buf: str, pos: int) -> tuple[str, str | None, int]:
    """Match a message header at ``pos``.

    Returns ``(kind, recipient, end)``: kind ``full`` with the recipient
    (``None`` for an unaddressed header) and the index after ``<|message|>``;
    ``partial`` when the buffer ends inside a possible header; else ``none``.
    """
    best = _NONE
    for with_start in (True, False):
        for addressed in (True, False):
            for with_assistant in (True, False):
                if with_start and not with_assistant:
                    continue
                kind, recipient, end = _match_form(buf, pos, with_start, with_assistant, addressed)
                if kind == _FULL:
                    return kind, recipient, end
                if kind == _PARTIAL:
                    best = _PARTIAL
    return best, None, pos


def _match_form(buf: str, pos: int, with_start: bool, with_assistant: bool, addressed: bool):
    prefix = (START if with_start else "") + ("assistant" if with_assistant else "")
    if addressed:
        prefix += " to=" if with_assistant else "to="
    kind = _literal(buf, pos, prefix)
    if kind != _FULL:
        return kind, None, pos
    i = pos + len(prefix)
    recipient = None
    if addressed:
        j = _RECIPIENT.match(buf, i).end()
        if j == len(buf):
            return _PARTIAL, None, pos
        if j == i:
            return _NONE, None, pos
        recipient, i = buf[i:j], j
    kind = _literal(buf, i, MESSAGE)
    if kind != _FULL:
        return kind, None, pos
    return _FULL, recipient, i + len(MESSAGE)


def _control_at(buf: str, pos: int) -> tuple[str, str | None]:
    """A known control token at ``pos``: (full, token), (partial, None) or (none, None)."""
    partial = False
    for token in CONTROL_TOKENS:
        kind = _literal(buf, pos, token)
        if kind == _FULL:
            return _FULL, token
        partial = partial or kind == _PARTIAL
    return (_PARTIAL if partial else _NONE), None


_BACKTICK_OPEN = re.compile(r" {0,3}(`{3,})[^`]*")
_TILDE_OPEN = re.compile(r" {0,3}(~{3,}).*", re.S)


def _opening_fence(line: str) -> tuple[str, int] | None:
    """The fence a delimiter line opens, as (character, run length)."""
    match = _BACKTICK_OPEN.fullmatch(line) or _TILDE_OPEN.fullmatch(line)
    return (match.group(1)[0], len(match.group(1))) if match else None


def _closes_fence(line: str, fence: tuple[str, int]) -> bool:
    char, length = fence
    stripped = line.lstrip(" ")
    if len(line) - len(stripped) > 3:
        return False
    run = len(stripped) - len(stripped.lstrip(char))
    return run >= length and stripped[run:].strip(" \t") == ""


class AtemBlockScanner:
    """Follows one ATEM block's framing, from
    just after ``<atem:function_calls>`` to its closing tag.

    It tracks only the structure: where parameter values start and end (so
    that they stay opaque) and where the block ends. Names, duplicates and
    values are the tool parser's business. Work is linear in the text.
    """

    # states
    BLOCK, INVOKE_NAME, IN_INVOKE, PARAM_NAME, VALUE, AFTER_INVOKE = range(6)
    _EXPECTED = {
        BLOCK: ((_INVOKE_OPEN, INVOKE_NAME),),
        IN_INVOKE: ((_PARAM_OPEN, PARAM_NAME), (_INVOKE_CLOSE, AFTER_INVOKE)),
        AFTER_INVOKE: ((_INVOKE_OPEN, INVOKE_NAME), (ATEM_CLOSE, None)),
    }

    def __init__(self) -> None:
        self.state: int | None = self.BLOCK
        self._name_length = 0

    def advance(self, buf: str, pos: int) -> tuple[int, str]:
        """Consume from ``pos``; returns ``(end, status)`` with status ``more``
        (everything up to ``end`` belongs to the block, more text is needed),
        ``done`` (the block ends at ``end``) or ``malformed`` (the text at
        ``end`` deviates from the grammar)."""
        while True:
            state = self.state
            if state is None:
                return pos, "done"
            if state in (self.INVOKE_NAME, self.PARAM_NAME):
                end = _ATEM_NAME.match(buf, pos).end()
                self._name_length += end - pos
                pos = end
                if pos == len(buf) or (pos + 1 == len(buf) and buf[pos] == '"'):
                    return pos, "more"
                if buf.startswith('">', pos) and self._name_length:
                    self._name_length = 0
                    self.state = self.IN_INVOKE if state == self.INVOKE_NAME else self.VALUE
                    pos += 2
                    continue
                return pos, "malformed"
            if state == self.VALUE:
                end = buf.find(_PARAM_CLOSE, pos)
                if end < 0:
                    return max(pos, len(buf) - len(_PARAM_CLOSE) + 1), "more"
                self.state = self.IN_INVOKE
                pos = end + len(_PARAM_CLOSE)
                continue
            pos = _WS_RUN.match(buf, pos).end()
            if pos == len(buf):
                return pos, "more"
            partial = False
            for literal, following in self._EXPECTED[state]:
                kind = _literal(buf, pos, literal)
                if kind == _FULL:
                    self.state = following
                    pos += len(literal)
                    break
                partial = partial or kind == _PARTIAL
            else:
                return pos, ("more" if partial else "malformed")


# -- the parser ---------------------------------------------------------------------

_REASONING, _VISIBLE, _TOOL = "reasoning", "visible", "tool"


@attrs.define
class _MessageState:
    recipient: str
    kind: str
    fence: tuple[str, int] | None = None
    line: list[str] = attrs.Factory(list)  # body text of the current line
    line_dead: bool = False  # the current line can be neither delimiter nor line start
    started: bool = False  # the body has emitted text (separator done)

    @property
    def at_line_start(self) -> bool:
        return not self.line and not self.line_dead


_COMPACT_AT = 1 << 16  # consumed characters kept before the buffer is compacted


class ChannelParser:
    """Incremental parser of one generation's output (see the module docstring).

    ``tools_active``: the request has active tools and a tool parser runs;
    otherwise tool-addressed messages and intent blocks are content.
    ``hide_reasoning``: drop reasoning events (``reasoning: {"exclude": true}``).
    """

    def __init__(self, *, tools_active: bool, hide_reasoning: bool = False) -> None:
        self.tools_active = tools_active
        self.hide_reasoning = hide_reasoning
        self._buf = ""
        self._pos = 0
        self._mode = "header"  # header | body | block | tool | toolblock | done
        self._msg: _MessageState | None = None
        self._tool_end_pending = False  # a tool message ended by a terminator, header undecided
        self._block: AtemBlockScanner | None = None
        self._used = {_REASONING: False, _VISIBLE: False}
        self._events: list[ChannelEvent] = []
        self._header_start = 0  # where the current header position began (absolute offset)
        self._base = 0  # absolute offset of _buf[0]: consumed text is dropped (see _compact)
        self.end: EndReason | None = None
        self.message_starts: list[tuple[int, str]] = []
        """Where each message begins, as ``(offset, channel)`` in characters of
        the text fed so far; ``channel`` is ``reasoning``, ``visible`` or
        ``tool``. A message begins where its header position begins (right
        after the previous structural terminator, or at 0), so every character
        of the output belongs to exactly one message: leading whitespace and
        the header to the message they open, a terminator to the message it
        ends, unexpected text after a terminator to the message it continues.
        Used to attribute generated token ids (see :func:`channel_at`)."""

    # -- public API ---------------------------------------------------------------
    def feed(self, text: str) -> list[ChannelEvent]:
        """Add generated text; returns the events it settles."""
        if self._mode == "done":
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._run(eof=False)
        self._compact()
        return self._take()

    def _compact(self) -> None:
        """Drop consumed text so a long output fed token by token stays linear.

        One character before the scan position is kept: the scanner looks back
        one character to tell a line start."""
        cut = self._pos - 1
        if cut > _COMPACT_AT and 2 * cut > len(self._buf):
            self._buf = self._buf[cut:]
            self._pos -= cut
            self._base += cut

    def finish(self, end: EndReason) -> list[ChannelEvent]:
        """End of generation: apply the end-of-output rules."""
        if end not in END_REASONS:
            raise ValueError(f"unknown end reason {end!r}")
        if self._mode == "done":
            raise RuntimeError("finish() called twice")
        self.end = end
        self._run(eof=True)
        if self._mode in ("block", "toolblock"):
            # Text an open ATEM value still held back belongs to the block.
            self._hand_off_block(self._buf[self._pos :])
        if self._mode == "tool" or self._mode == "toolblock" or (self._mode == "block" and self.tools_active):
            self._emit(ToolMessageEnd(self._msg.recipient, False, self._mode == "block"))
        elif self._tool_end_pending:
            self._emit(ToolMessageEnd(self._msg.recipient, True))
        self._mode = "done"
        self._buf = ""
        return self._take()

    # -- emission -----------------------------------------------------------------
    def _take(self) -> list[ChannelEvent]:
        events, self._events = self._events, []
        return events

    def _emit(self, event: ChannelEvent) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(event, (ReasoningDelta, ContentDelta)) and type(last) is type(event):
            self._events[-1] = type(event)(last.text + event.text)
        elif isinstance(event, ToolDelta) and isinstance(last, ToolDelta) and last.intent == event.intent:
            self._events[-1] = ToolDelta(event.recipient, last.text + event.text, event.intent)
        else:
            self._events.append(event)

    def _body_text(self, text: str, *, shown: bool = True, line: bool = True) -> None:
        """Text of the current reasoning/visible body. ``shown=False`` marks a
        control token removed from reasoning: it counts for line tracking only;
        ``line=False`` keeps the text out of the current line (a newline)."""
        if not text:
            return
        msg = self._msg
        if line:
            msg.line.append(text)
        if not shown:
            return
        channel = _REASONING if msg.kind == _REASONING else _VISIBLE
        if not msg.started:
            msg.started = True
            if self._used[channel]:
                text = "\n\n" + text
            self._used[channel] = True
        if channel == _REASONING:
            if not self.hide_reasoning:
                self._emit(ReasoningDelta(text))
        else:
            self._emit(ContentDelta(text))

    def _newline(self) -> None:
        msg = self._msg
        if not msg.line_dead:
            line = "".join(msg.line)
            if msg.fence is None:
                msg.fence = _opening_fence(line)
            elif _closes_fence(line, msg.fence):
                msg.fence = None
        msg.line.clear()
        msg.line_dead = False

    # -- the scanner --------------------------------------------------------------
    def _run(self, eof: bool) -> None:
        step = {
            "header": self._step_header,
            "body": self._step_body,
            "block": self._step_block,
            "tool": self._step_tool,
            "toolblock": self._step_block,
        }
        while self._pos < len(self._buf) and step[self._mode](eof):
            pass

    def _kind_of(self, recipient: str | None) -> str:
        if recipient == "self":
            return _REASONING
        if recipient in (None, "user") or not self.tools_active:
            return _VISIBLE
        return _TOOL

    def _step_header(self, eof: bool) -> bool:
        """At a header position."""
        buf, pos = self._buf, self._pos
        match = _NOT_WS.search(buf, pos)
        if match is None:
            if eof:  # trailing whitespace after the last terminator
                self._pos = len(buf)
            return False
        start = match.start()
        kind, recipient, end = match_header(buf, start)
        if kind == _PARTIAL and not eof:
            return False
        if kind == _FULL:
            if self._tool_end_pending:
                self._emit(ToolMessageEnd(self._msg.recipient, True))
                self._tool_end_pending = False
            recipient = recipient or "user"
            kind_of = self._kind_of(recipient)
            self._msg = _MessageState(recipient, kind_of)
            self.message_starts.append((self._header_start, kind_of))
            self._mode = "tool" if kind_of == _TOOL else "body"
            self._pos = end
            return True
        if kind == _PARTIAL:
            # End of output inside a possible header (` to=us`, ` to=self<|mess`,
            # `assistant`): framing the model did not finish, dropped with the
            # whitespace before it (output-grammar 5.3 as issue 25 amends it:
            # a bare ` to=` fragment is no longer literal text).
            self._pos = len(buf)
            return False
        # Unexpected text or a bare fragment at EOF: it opens the
        # implicit visible message, or continues the previous one.
        if self._msg is None:
            self._msg = _MessageState("user", _VISIBLE)
            self.message_starts.append((0, _VISIBLE))
            self._mode = "body"
        else:
            self._mode = "tool" if self._msg.kind == _TOOL else "body"
            self._tool_end_pending = False
        return True

    def _terminate(self, end: int) -> None:
        """A structural terminator ends the current message at ``end``."""
        msg = self._msg
        if msg.kind == _TOOL:
            self._tool_end_pending = True
        else:
            msg.fence = None
            if msg.line:
                msg.line_dead = True
        self._mode = "header"
        self._pos = end
        self._header_start = self._base + end

    def _atem_enabled(self) -> bool:
        return self._msg.kind == _VISIBLE

    def _step_body(self, eof: bool) -> bool:
        """Inside a reasoning or visible message."""
        buf, pos, msg = self._buf, self._pos, self._msg
        char = buf[pos]
        if char == "\n":
            self._body_text("\n", line=False)
            self._newline()
            self._pos = pos + 1
            return True
        if char != "<":
            end = _PLAIN.search(buf, pos)
            end = end.start() if end else len(buf)
            self._body_text(buf[pos:end])
            self._pos = end
            return True
        if self._atem_enabled() and msg.at_line_start and msg.fence is None:
            kind = _literal(buf, pos, ATEM_OPEN)
            if kind == _FULL:
                self._block = AtemBlockScanner()
                self._mode = "block"
                self._hand_off_block(ATEM_OPEN)
                self._pos = pos + len(ATEM_OPEN)
                return True
            if kind == _PARTIAL and not eof:
                return False
        kind, token = _control_at(buf, pos)
        if kind == _PARTIAL:
            if not eof:
                return False
            if len(buf) - pos >= 2:  # 5.1: a trailing "<|..." fragment is dropped
                self._pos = len(buf)
                return False
        if kind != _FULL:
            self._body_text("<")
            self._pos = pos + 1
            return True
        end = pos + len(token)
        if token in TERMINATORS:
            if msg.fence is None or (not msg.line_dead and _closes_fence("".join(msg.line), msg.fence)):
                self._terminate(end)
                return True
        elif token == START:
            header, _, _ = match_header(buf, pos)
            if header == _PARTIAL:
                if eof:  # 5.2: a trailing incomplete <|start|> header is dropped
                    self._pos = len(buf)
                return False
        # A control token that is not structural: literal in content, removed
        # from reasoning.
        self._body_text(token, shown=msg.kind != _REASONING)
        self._pos = end
        return True

    def _hand_off_block(self, text: str) -> None:
        if self.tools_active and self._mode == "block":
            self._emit(ToolDelta(self._msg.recipient, text, intent=True))
        elif self._mode == "block":
            self._body_text(text)
        else:
            self._emit(ToolDelta(self._msg.recipient, text))

    def _step_block(self, eof: bool) -> bool:
        """Inside an ATEM block: values are opaque."""
        end, status = self._block.advance(self._buf, self._pos)
        self._hand_off_block(self._buf[self._pos : end])
        self._pos = end
        if status == "more":
            return False
        self._block = None
        if self._mode == "toolblock":
            self._mode = "tool"
            return True
        if self.tools_active:
            self._emit(ToolMessageEnd(self._msg.recipient, status == "done", intent=True))
        msg = self._msg
        msg.line.clear()
        msg.line_dead = not self._buf.startswith("\n", end - 1) or status == "done"
        self._mode = "body"
        return True

    def _step_tool(self, eof: bool) -> bool:
        """Inside a tool-addressed message with tools active."""
        buf, pos = self._buf, self._pos
        char = buf[pos]
        if char in _WS:
            end = _WS_RUN.match(buf, pos).end()
        elif char == "<":
            kind = _literal(buf, pos, ATEM_OPEN)
            if kind == _FULL:
                self._emit(ToolDelta(self._msg.recipient, ATEM_OPEN))
                self._block = AtemBlockScanner()
                self._mode = "toolblock"
                self._pos = pos + len(ATEM_OPEN)
                return True
            control, token = _control_at(buf, pos)
            if (kind == _PARTIAL or control == _PARTIAL) and not eof:
                return False
            if control == _FULL and token in TERMINATORS:
                self._terminate(pos + len(token))
                return True
            if control == _PARTIAL and len(buf) - pos >= 2:
                self._pos = len(buf)  # 5.1
                return False
            end = pos + (len(token) if control == _FULL else 1)
        else:
            match = _TOOL_PLAIN.search(buf, pos)
            end = match.start() if match else len(buf)
        self._emit(ToolDelta(self._msg.recipient, buf[pos:end]))
        self._pos = end
        return True


def channel_at(message_starts: list[tuple[int, str]], offset: int) -> str | None:
    """The channel (``reasoning``, ``visible``, ``tool``) of the message that
    holds character ``offset``, given a parser's :attr:`ChannelParser.message_starts`;
    ``None`` before the first message (nothing parsed yet)."""
    index = bisect.bisect_right(message_starts, (offset, "\uffff")) - 1
    return message_starts[index][1] if index >= 0 else None


def collect(events: list[ChannelEvent]) -> ParsedOutput:
    """Assemble a complete event list into a :class:`ParsedOutput`."""
    reasoning: list[str] = []
    content: list[str] = []
    tool_messages: list[ToolMessage] = []
    body: list[str] = []
    for event in events:
        if isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolDelta):
            body.append(event.text)
        else:
            tool_messages.append(ToolMessage(event.recipient, "".join(body), event.complete, event.intent))
            body = []
    return ParsedOutput("".join(reasoning) or None, "".join(content) or None, tuple(tool_messages))


def parse_output(
    text: str, *, tools_active: bool, hide_reasoning: bool = False, end: EndReason = "eos"
) -> ParsedOutput:
    """Buffered parsing: exactly ``feed(text)`` followed by ``finish(end)``."""
    parser = ChannelParser(tools_active=tools_active, hide_reasoning=hide_reasoning)
    return collect(parser.feed(text) + parser.finish(end))

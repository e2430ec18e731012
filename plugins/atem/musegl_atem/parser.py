"""ATEM markup: from the raw text of a tool message to invokes.

The channel parser (:mod:`musegl_core.chat.channels`) decides *where* tool
text is: the body of a tool-addressed message, or a line-start
``<atem:function_calls>`` block inside a visible message. This module reads
one such piece once it has ended and returns its invokes, or says that it is
malformed (a definite deviation from the grammar) or incomplete (the output
ended while it could still have become valid)::

    BLOCK  = "<atem:function_calls>" WS* INVOKE { WS* INVOKE } WS* "</atem:function_calls>"
    INVOKE = "<atem:invoke name=\\"" NAME "\\">" WS* { PARAM WS* } "</atem:invoke>"
    PARAM  = "<atem:parameter name=\\"" NAME "\\">" VALUE "</atem:parameter>"

Parameter values are opaque: everything up to the first
``</atem:parameter>`` is kept verbatim. The scan is one left-to-right pass,
linear in the text (values are located with ``str.find``).
"""

from __future__ import annotations

import re
from typing import Literal

import attrs

BLOCK_OPEN = "<atem:function_calls>"
BLOCK_CLOSE = "</atem:function_calls>"
INVOKE_OPEN = '<atem:invoke name="'
INVOKE_CLOSE = "</atem:invoke>"
PARAM_OPEN = '<atem:parameter name="'
PARAM_CLOSE = "</atem:parameter>"
NAME_CLOSE = '">'

_WS = re.compile(r"[ \t\r\n]*")
_NAME = re.compile(r'[^"<>\r\n]*')

PieceStatus = Literal["complete", "incomplete", "malformed"]


@attrs.frozen
class Parameter:
    """One ``<atem:parameter>``: its name and raw body, verbatim."""

    name: str
    value: str


@attrs.frozen
class Invoke:
    """One completed ``<atem:invoke>`` with its parameters in output order."""

    name: str
    parameters: tuple[Parameter, ...]


@attrs.frozen
class ScannedPiece:
    """The result of reading one piece of tool text.

    ``invokes`` are the invokes that were completed before the piece ended
    (or before the deviation, when ``status`` is ``malformed``); ``problem``
    says what is wrong for ``malformed`` and ``incomplete`` pieces.
    """

    status: PieceStatus
    invokes: tuple[Invoke, ...]
    problem: str = ""


class _Deviation(Exception):
    def __init__(self, problem: str, incomplete: bool):
        super().__init__(problem)
        self.problem = problem
        self.incomplete = incomplete


class _Reader:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0

    def skip_ws(self) -> None:
        self.pos = _WS.match(self.text, self.pos).end()

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def expect(self, *literals: str) -> str:
        """Consume whichever of ``literals`` comes next."""
        for literal in literals:
            if self.text.startswith(literal, self.pos):
                self.pos += len(literal)
                return literal
        rest = self.text[self.pos : self.pos + max(map(len, literals))]
        incomplete = any(literal.startswith(rest) for literal in literals) and self.pos + len(rest) >= len(self.text)
        wanted = " or ".join(repr(literal) for literal in literals)
        found = "the end of the output" if not rest else repr(rest[:30])
        raise _Deviation(f"expected {wanted} at offset {self.pos}, found {found}", incomplete)

    def name(self, what: str) -> str:
        start = self.pos
        end = _NAME.match(self.text, start).end()
        self.pos = end
        if end == len(self.text) or (end + 1 == len(self.text) and self.text[end] == '"'):
            raise _Deviation(f"the output ended inside a {what} name", True)
        if not self.text.startswith(NAME_CLOSE, end):
            raise _Deviation(f"malformed {what} name at offset {start}", False)
        if end == start:
            raise _Deviation(f"empty {what} name at offset {start}", False)
        self.pos = end + len(NAME_CLOSE)
        return self.text[start:end]

    def value(self) -> str:
        end = self.text.find(PARAM_CLOSE, self.pos)
        if end < 0:
            raise _Deviation("the output ended inside a parameter value", True)
        value = self.text[self.pos : end]
        self.pos = end + len(PARAM_CLOSE)
        return value


def _block(reader: _Reader, invokes: list[Invoke]) -> None:
    """One block, from its opening tag; appends each invoke as it completes."""
    reader.expect(BLOCK_OPEN)
    reader.skip_ws()
    reader.expect(INVOKE_OPEN)
    while True:
        name = reader.name("tool")
        parameters: list[Parameter] = []
        seen: set[str] = set()
        while True:
            reader.skip_ws()
            if reader.expect(PARAM_OPEN, INVOKE_CLOSE) == INVOKE_CLOSE:
                break
            param = reader.name("parameter")
            if param in seen:
                raise _Deviation(f"parameter {param!r} of tool {name!r} appears twice", False)
            seen.add(param)
            parameters.append(Parameter(param, reader.value()))
        invokes.append(Invoke(name, tuple(parameters)))
        reader.skip_ws()
        if reader.expect(INVOKE_OPEN, BLOCK_CLOSE) == BLOCK_CLOSE:
            return


def scan_piece(text: str, *, message: bool, closed: bool) -> ScannedPiece:
    """Read one piece of tool text.

    ``message``: the piece is the body of a tool-addressed message (optional
    whitespace, one or more blocks, optional whitespace); otherwise it is
    exactly one intent block. ``closed``: the piece ended at its delimiter (a
    terminator, or the block's closing tag) rather than at the end of the
    output; a closed piece that stops short of the grammar is malformed.
    """
    reader = _Reader(text)
    invokes: list[Invoke] = []
    try:
        if message:
            reader.skip_ws()
            _block(reader, invokes)
            while True:
                reader.skip_ws()
                if reader.at_end():
                    break
                _block(reader, invokes)
        else:
            _block(reader, invokes)
            if not reader.at_end():
                raise _Deviation(f"unexpected text after the block at offset {reader.pos}", False)
    except _Deviation as deviation:
        if deviation.incomplete and not closed:
            return ScannedPiece("incomplete", tuple(invokes), deviation.problem)
        problem = deviation.problem if not deviation.incomplete else f"the tool message ended early: {deviation.problem}"
        return ScannedPiece("malformed", tuple(invokes), problem)
    return ScannedPiece("complete", tuple(invokes))

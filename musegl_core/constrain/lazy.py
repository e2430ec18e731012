"""Lazily activated call grammars: free output until the model opens a tool call.

``tool_choice: "auto"`` with ``strict: true`` tools (``docs/constrained.md``)
leaves the output free — reasoning, answers, control tokens, fences — and
constrains only the tool calls. :class:`LazyCallProcessor` follows the
generated ids with a small scanner of the message structure
(``output-grammar.md`` section 1) and activates a grammar
(:class:`~musegl_core.engine.request.LazyGrammar`) at two places:

* **a tool message**: the ``<|message|>`` of a header whose recipient is a
  tool (`` to=NAME``, NAME neither ``self`` nor ``user``); the grammar then
  covers the whole body (the call markup and the terminator);
* **a call in a visible message**: the trigger text (``<atem:function_calls>``)
  at a line start of a visible message's body; the matcher is fed from the
  token where the trigger begins (its lead rule absorbs that token's text
  before the trigger), and the message continues freely after the markup.

Reasoning (`` to=self``) never activates it: ATEM markup there is reasoning
text (output-grammar 2.2 rule 6). Fences are not tracked, so a line-start
trigger inside a fenced block of a visible message is constrained too (the
markup then written is well-formed; nothing else changes). When the grammar
has run to its end (``is_stopped``) the output is free again and the next
call can activate it anew. If the ids that completed the trigger carry text
the grammar refuses (the token after the trigger was drawn unconstrained),
that call stays free and is validated after generation as before.

The processor is a function of the generated ids: ids that were replaced
(rejected drafts) are rolled back from snapshots of the last
:data:`SNAPSHOTS` positions (deeper rollbacks rescan from the start).
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Sequence

import attrs
import numpy as np

from musegl_core.constrain.failure import failure_reason

#: positions whose scanner state is kept for rollbacks
SNAPSHOTS = 64
#: body bytes kept for the trigger search
_TAIL = 256
_HEADER = re.compile(r"\s*(?:assistant )?to=([A-Za-z0-9_.\-]+)")
_RECIPIENT = re.compile(r"[A-Za-z0-9_.\-]*")


@attrs.frozen
class _Scan:
    """The message structure after some generated ids."""

    at_header: bool = True  # between a terminator (or the start) and the next <|message|>
    kind: str = "start"  # the current (at a header position: the previous) message's class
    text: bytes = b""  # the header text at a header position, else the body's last bytes
    body_start: int = 0  # body offset of text[0]
    line_start_at_zero: bool = True  # body offset 0 is a line start
    starts: tuple[tuple[int, int], ...] = ()  # (generated index, offset in text/body) of the last tokens
    scan_from: int = 0  # body offsets before this are searched or constrained already
    active: str = ""  # "" free, "tool" or "visible": the grammar running
    fed_from: int = 0  # generated index of the first id the running matcher consumed


def _header_prefix(text: str) -> bool:
    """Can ``text`` (after a terminator) still become a header?"""
    t = text.lstrip()
    for word in ("assistant to=", "to="):
        if word.startswith(t) or (t.startswith(word) and _RECIPIENT.fullmatch(t[len(word):])):
            return True
    return False


class LazyCallProcessor:
    """The engine's ``LogitsProcessor`` for a :class:`LazyGrammar`."""

    def __init__(self, tool_matcher: Any, visible_matcher: Any, trigger: str, tokenizer: Any, ll_tokenizer: Any,
                 words: int):
        # pristine copies: a matcher that ran to its end cannot always be reset
        self.fresh = {"tool": tool_matcher, "visible": visible_matcher}
        self.matchers = {name: m.deep_copy() for name, m in self.fresh.items()}
        self.trigger = trigger.encode()
        self.words = words
        self.ll = ll_tokenizer
        self.message_id = tokenizer.message_id
        self.start_id = tokenizer.start_id
        self.terminators = {tokenizer.eom_id, tokenizer.eot_id}
        self.ids: list[int] = []
        self.states: deque[_Scan] = deque([_Scan()], maxlen=SNAPSHOTS + 1)  # states[-1]: after self.ids
        self.activations = 0  # how many calls the grammar constrained (tests and metrics read it)
        #: why a running call grammar failed on ids it allowed (the engine fails the request), else None
        self.failure: str | None = None
        self.mask_seconds = 0.0
        self.masks = 0

    # -- the LogitsProcessor protocol --------------------------------------------------
    def mask(self, generated: Sequence[int]) -> Any:
        import time

        started = time.perf_counter()
        try:
            self._follow(generated)
            state = self.states[-1]
            if not state.active:
                return None
            matcher = self.matchers[state.active]
            packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            if matcher.is_error():  # a budget ran out: never continue unconstrained
                self.failure = self.failure or failure_reason(matcher)
                return None
            if len(packed) < self.words:
                packed = np.concatenate([packed, np.zeros(self.words - len(packed), dtype=np.uint32)])
            return packed[: self.words]
        finally:
            self.mask_seconds += time.perf_counter() - started
            self.masks += 1

    # -- following the ids ----------------------------------------------------------------
    def _follow(self, generated: Sequence[int]) -> None:
        ids = self.ids
        common = min(len(ids), len(generated))
        while common and ids[common - 1] != generated[common - 1]:
            common -= 1
        if common < len(ids):
            self._rollback(common)
        for index in range(len(self.ids), len(generated)):
            self._push(int(generated[index]))

    def _rollback(self, keep: int) -> None:
        back = len(self.ids) - keep
        if back >= len(self.states):  # deeper than the snapshots: rescan from the start
            replay = self.ids[:keep]
            self.ids, self.states = [], deque([_Scan()], maxlen=SNAPSHOTS + 1)
            for token in replay:
                self._push(token)
            return
        del self.ids[keep:]
        for _ in range(back):
            self.states.pop()
        state = self.states[-1]
        if state.active:  # re-feed the running call up to the kept ids
            matcher = self._restart(state.active)
            if state.fed_from < len(self.ids):
                matcher.try_consume_tokens(self.ids[state.fed_from:])

    def _push(self, token: int) -> None:
        state = self.states[-1]
        index = len(self.ids)
        self.ids.append(token)
        if state.active:
            matcher = self.matchers[state.active]
            taken = matcher.try_consume_tokens([token])  # a refused id (a draft) leaves no error state
            if matcher.is_error():  # on an id it allowed: a budget ran out
                self.failure = self.failure or failure_reason(matcher)
                state = attrs.evolve(state, active="")
            elif not taken or matcher.is_stopped():
                state = attrs.evolve(state, active="")
        state = self._scan(state, token, index)
        self.states.append(state)

    def _scan(self, s: _Scan, token: int, index: int) -> _Scan:
        if token in self.terminators:
            return attrs.evolve(s, at_header=True, text=b"", starts=())
        if s.at_header:
            if token == self.start_id:
                return attrs.evolve(s, text=b"", starts=())
            if token == self.message_id:
                match = _HEADER.fullmatch(s.text.decode("utf-8", "replace"))
                recipient = match.group(1) if match else "user"
                kind = {"self": "reasoning", "user": "visible"}.get(recipient, "tool")
                s = attrs.evolve(s, at_header=False, kind=kind, text=b"", body_start=0, line_start_at_zero=True,
                                 starts=(), scan_from=0)
                return self._activate(s, "tool", index + 1) if kind == "tool" and not s.active else s
            piece = self._bytes(token)
            s = attrs.evolve(s, text=s.text + piece, starts=s.starts + ((index, len(s.text)),))
            if _header_prefix(s.text.decode("utf-8", "replace")):
                return s
            # Not a header: the text opens the implicit visible message (at the
            # start) or continues the previous one (output-grammar 2.1).
            first = s.kind == "start"
            s = attrs.evolve(s, at_header=False, kind="visible" if first else s.kind, body_start=0,
                             line_start_at_zero=first, scan_from=0)
            return self._search(s)
        piece = self._bytes(token)
        end = s.body_start + len(s.text)
        text = s.text + piece
        cut = max(0, len(text) - _TAIL)
        s = attrs.evolve(s, text=text[cut:], body_start=s.body_start + cut,
                         starts=(s.starts + ((index, end),))[-(len(self.trigger) + 2):])
        return self._search(s)

    def _search(self, s: _Scan) -> _Scan:
        """Activate the visible-message grammar at a new line-start trigger."""
        end = s.body_start + len(s.text)
        if s.active or s.kind != "visible":
            return attrs.evolve(s, scan_from=end) if s.active else s
        found = None
        at = s.text.find(self.trigger, max(0, s.scan_from - s.body_start))
        while at >= 0:
            offset = s.body_start + at
            if (offset == 0 and s.line_start_at_zero) or (at > 0 and s.text[at - 1:at] == b"\n"):
                found = offset
                break
            at = s.text.find(self.trigger, at + 1)
        if found is None:
            return s
        first = next((i for i, offset in reversed(s.starts) if offset <= found), None)
        s = attrs.evolve(s, scan_from=end)
        return s if first is None else self._activate(s, "visible", first)

    def _activate(self, s: _Scan, name: str, fed_from: int) -> _Scan:
        matcher = self._restart(name)
        self.activations += 1
        s = attrs.evolve(s, active=name, fed_from=fed_from)
        if fed_from < len(self.ids):
            fed = self.ids[fed_from:]
            taken = matcher.try_consume_tokens(fed)
            if matcher.is_error():
                self.failure = self.failure or failure_reason(matcher)
            if taken < len(fed) or matcher.is_error():
                return attrs.evolve(s, active="")
        if matcher.is_stopped():
            return attrs.evolve(s, active="")
        return s

    def _restart(self, name: str) -> Any:
        self.matchers[name] = matcher = self.fresh[name].deep_copy()
        return matcher

    def _bytes(self, token: int) -> bytes:
        return self.ll.decode_bytes([token])

"""Generated-token replay: resubmitted answers reuse the exact ids the model produced.

A client resubmits the conversation each turn with the previous answer as an
assistant message. The template renders that message as text, which
tokenizes differently from what the model generated (and may lack the
reasoning it hid). For a session, the engine keeps, per answered turn, where
the generation started and the ids it produced. When a new prompt

* repeats the session's executed prompt exactly up to that point (the
  preceding history: an edited or compacted earlier message breaks it), and
* continues with a rendered assistant turn whose visible meaning (content,
  tool-addressed messages, and reasoning when the client sent it) equals the
  generated turn's,

the rendered turn is replaced by the generated ids (closed with ``<|eot|>``),
so the session's KV for them is reused instead of recomputed. An identical
visible answer after a different history never picks up another turn's ids.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

import attrs

from musegl_core.chat.channels import parse_output


@attrs.frozen
class ReplayLog:
    """The last executed prompt of a session and its answered turns (immutable:
    the control thread reads a session's log while the engine may replace it)."""

    executed: tuple[int, ...] = ()
    turns: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (start, turn ids)


@attrs.frozen
class ReplayPlan:
    """``Replayer.apply`` computed ahead of time on the control thread, against ``log``.
    The engine uses it only if the session's log is still that same object."""

    log: ReplayLog
    keys: tuple[int, ...]
    kept: tuple[tuple[int, tuple[int, ...]], ...]


#: Turns whose parsed meaning a :class:`Replayer` remembers: an agent's every request re-sends
#: every earlier answer, so each turn's text is decoded and parsed once, not once a request.
MEANINGS_KEPT = 4096
#: ... and the most ids those turns may hold in all. A count alone does not bound the memory when
#: turns are long: an id held in a key takes 40 bytes (a pointer and an int object), so 4,096
#: turns of 8,192 ids would hold 1.25 GiB in keys alone, before their parsed text. 524,288 ids take
#: 20 MiB in keys: room for the turns of several long agent sessions.
MEANINGS_KEPT_IDS = 1 << 19


class MeaningCache:
    """The parsed meaning of turns, least recently used first out, within :data:`MEANINGS_KEPT`
    turns and :data:`MEANINGS_KEPT_IDS` ids (a turn longer than that is parsed, never kept).
    Thread-safe: the preparation threads and the engine thread share it; a parse runs outside
    the lock (two threads may parse the same turn once each)."""

    def __init__(self, parse, turns: int = MEANINGS_KEPT, ids: int = MEANINGS_KEPT_IDS):
        self.parse = parse
        self.max_turns, self.max_ids = turns, ids
        self.ids = 0  # ids held by the kept turns
        self._kept: collections.OrderedDict[tuple[int, ...], object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def __call__(self, key: tuple[int, ...]):
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                return found
        parsed = self.parse(key)
        if len(key) > self.max_ids:
            return parsed
        with self._lock:
            if key not in self._kept:
                self._kept[key] = parsed
                self.ids += len(key)
                while len(self._kept) > self.max_turns or self.ids > self.max_ids:
                    old, _ = self._kept.popitem(last=False)
                    self.ids -= len(old)
        return parsed


class Replayer:
    def __init__(self, tokenizer, end_ids: frozenset[int]):
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.eot = tokenizer.eot_id
        # (thread-safe: the preparation threads and the engine thread share the replayer)
        self._parsed = MeaningCache(self._parse)

    def _parse(self, ids: tuple[int, ...]):
        return parse_output(self.tokenizer.decode(list(ids)), tools_active=True)

    def turn_ids(self, generated: Sequence[int]) -> tuple[int, ...]:
        """A generated answer as a closed turn: ends with exactly one ``<|eot|>``."""
        ids = list(generated)
        if ids and ids[-1] in self.end_ids:
            ids.pop()
        return (*ids, self.eot)

    def _meaning(self, ids: Sequence[int], with_reasoning: bool) -> tuple:
        parsed = self._parsed(tuple(ids))
        messages = tuple((t.recipient, t.body) for t in parsed.tool_messages)
        return (parsed.content, messages, parsed.reasoning if with_reasoning else None)

    def same_turn(self, rendered: Sequence[int], generated: Sequence[int]) -> bool:
        if min(rendered, default=0) < 0:  # image rows are never part of an answer
            return False
        client_reasoning = bool(self._parsed(tuple(rendered)).reasoning)
        return self._meaning(rendered, client_reasoning) == self._meaning(generated, client_reasoning)

    def apply(self, log: ReplayLog, prompt: Sequence[int]) -> tuple[list[int], tuple[tuple[int, tuple[int, ...]], ...]]:
        """``prompt`` with every matching rendered turn replaced; and the turns kept."""
        current = list(prompt)
        kept: list[tuple[int, tuple[int, ...]]] = []
        checked = 0  # current[:checked] == log.executed[:checked]: each stretch is compared once
        for start, turn in log.turns:
            if len(current) <= start or tuple(current[checked:start]) != log.executed[checked:start]:
                break
            checked = start
            try:
                end = current.index(self.eot, start)
            except ValueError:
                break
            if not self.same_turn(current[start : end + 1], turn):
                break
            current[start : end + 1] = turn
            kept.append((start, turn))
        return current, tuple(kept)

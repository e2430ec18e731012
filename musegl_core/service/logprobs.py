"""``logprobs`` / ``top_logprobs`` of chat responses (OpenAI's shape).

The worker reports one :class:`~musegl_core.engine.executor.TokenLogprobs` per
generated id (``Tokens.logprobs``): the log-probability under the distribution
the id was drawn from (after ``logit_bias``, penalties, grammar masks and
temperature; before top-k/top-p/min-p truncation, docs/executor.md 5).

:class:`LogprobTracker` attributes them to the response's channels with its
own :class:`~musegl_core.chat.channels.ChannelParser`, fed one id's text at a
time (the front tokenizer's bytes of each id): an id gets a ``content`` entry
when feeding it released visible text, a ``reasoning_content`` entry when it
released reasoning text, and the entry's ``token`` is exactly the text it
released. Control tokens, headers and tool-call markup release no visible
text and get no entry. So the ``content`` entries' tokens concatenate to
``content`` exactly (the parser gives the same result for every split of
the output). The text an id released is usually its own text; where the
parser held back an ambiguous prefix (``<|``, a possible header or ATEM
opener), the held text goes with the id that resolved it, and the ``"\\n\\n"``
between two visible messages with the first id of the second.

An answer cut by ``max_tokens`` inside a multi-byte character ends with
U+FFFD in ``content`` (the decoding of the generated ids, as every decoder
of them gives it), and its last ``content`` entry's ``token`` is that U+FFFD
too, with the logprob of the id that cut the character: the entries still
concatenate to ``content``, streamed or not (docs/serving.md, "Logprobs").
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from musegl_core.chat import channels
from musegl_core.engine.detokenize import IncrementalDetokenizer

MAX_TOP_LOGPROBS = 20


@attrs.frozen
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@attrs.frozen
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


def _finite(value: float) -> float:
    return value if value > -1e30 else -9999.0  # JSON has no -inf (OpenAI clamps as well)


class LogprobTracker:
    def __init__(self, tokenizer: Any, tools_active: bool, top: int):
        self.tokenizer = tokenizer
        self.top = top
        self.parser = channels.ChannelParser(tools_active=tools_active, hide_reasoning=False)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.end_ids = frozenset(tokenizer.end_of_generation_ids)
        self.pending: list[tuple[str, Any]] = []  # (text not yet fed, its logprobs)
        self.seen = 0  # characters of the worker's (stop-checked) text so far
        self.fed = 0
        self.content: list[TokenLogprob] = []
        self.reasoning: list[TokenLogprob] = []

    def _entry(self, text: str, lp: Any) -> TokenLogprob:
        top = [
            TopLogprob(self._text(i), _finite(v), list(self.tokenizer.token_bytes(i)))
            for i, v in zip(lp.top_ids[: self.top], lp.top_logprobs[: self.top])
        ]
        return TokenLogprob(text, _finite(lp.logprob), list(text.encode("utf-8")), top)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def feed(self, ids: Sequence[int], logprobs: Sequence[Any], text: str, ignore_eos: bool = False) -> tuple[int, int]:
        """One ``Tokens`` event; returns how many content / reasoning entries it added."""
        before = len(self.content), len(self.reasoning)
        last = None
        for token, lp in zip(ids, logprobs):
            if token in self.end_ids and not ignore_eos:
                continue
            self.pending.append((self.detokenizer.push(token), lp))
            last = lp
        self.seen += len(text)
        if self.seen > self.fed + sum(len(piece) for piece, _ in self.pending) and self.detokenizer.pending_bytes:
            # The worker released the bytes of a character its output was cut inside (max_tokens) as
            # U+FFFD with this text: so does this tracker, with the logprob of the id that cut it, so
            # that the entry travels with the content it explains (streamed and not).
            self.pending.append((self.detokenizer.flush(), last))
        self._drain()
        return len(self.content) - before[0], len(self.reasoning) - before[1]

    def _drain(self) -> None:
        while self.pending and self.fed < self.seen:
            piece, lp = self.pending[0]
            take = piece[: self.seen - self.fed]
            if len(take) == len(piece):
                self.pending.pop(0)
            else:
                self.pending[0] = (piece[len(take):], lp)
            self.fed += len(take)
            self._route(self.parser.feed(take), lp)
        while self.pending and not self.pending[0][0]:
            self.pending.pop(0)  # ids that completed no character yet

    def _route(self, events: list[Any], lp: Any) -> None:
        content = "".join(e.text for e in events if isinstance(e, channels.ContentDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, channels.ReasoningDelta))
        if content and lp is not None:
            self.content.append(self._entry(content, lp))
        if reasoning and lp is not None:
            self.reasoning.append(self._entry(reasoning, lp))
        self.last = lp

    def finish(self, end: str) -> None:
        """The end of generation: text the parser held back goes with the last id."""
        tail = self.detokenizer.flush()
        if tail:
            self.pending.append((tail, getattr(self, "last", None)))
        self._drain()
        self._route(self.parser.finish(end), getattr(self, "last", None))

"""One choice's output: worker events → reasoning, content, tool calls and usage.

:class:`OutputAssembler` runs the channel parser over the worker's text
(reasoning vs visible content vs tool-addressed messages) and hands
tool-addressed text to the request's tool parser; at the end it validates the
call set and counts usage. Every API surface reads a choice through it
(directly, or through the typed events of
:class:`~musegl_core.service.generation.Generation`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

import attrs

from musegl_core.chat import channels
from musegl_core.service.logprobs import LogprobTracker
from musegl_core.service.events import Usage
from musegl_core.worker import messages as m


@attrs.frozen
class ToolCall:
    """A validated call: ``arguments`` is its JSON object as text."""

    id: str
    name: str
    arguments: str


@attrs.define
class Output:
    """What one batch of worker text adds to the response."""

    reasoning: str = ""
    content: str = ""


@attrs.frozen
class LogprobEntries:
    """Logprob entries (:class:`~musegl_core.service.logprobs.TokenLogprob`) by channel."""

    content: tuple = ()
    reasoning: tuple = ()


def reasoning_tokens(message_starts: list[tuple[int, str]], generated_chars: Sequence[int]) -> int:
    """How many generated ids belong to reasoning messages (docs/protocol.md: reasoning tokens).

    Which ids count: every id of a ``to=self`` message, from the start of its
    header position (the whitespace and header that open it) through its
    structural terminator, including text that continues it after a
    terminator and, when generation ends inside it, the end-of-generation id.
    Ids of visible and tool messages do not count; neither do ids of an
    incomplete header at the end of the output (they stay with the message
    before them).

    How: the worker reports, per generated id, how many characters its
    detokenizer added when that id arrived (``Done.generated_chars``; the id
    that starts a multi-byte character gets the character). The running sum
    is the character offset at which each id begins in the worker's text, so
    the channel parser's :attr:`~musegl_core.chat.channels.ChannelParser.message_starts`
    tell each id's message. No id is detokenized twice.
    """
    count, offset = 0, 0
    for chars in generated_chars:
        count += channels.channel_at(message_starts, offset) == "reasoning"
        offset += chars
    return count


def end_of_generation(done: m.Done) -> str:
    """The channel parser's end kind: ``eos``, ``stop`` (a request stop),
    ``length`` or ``cancel``."""
    if done.finish_reason == "length":
        return "length"
    if done.finish_reason == "cancelled":
        return "cancel"
    return "stop" if done.matched_stop is not None else "eos"


def tool_call(call: Any) -> ToolCall:
    """A validated call from the tool parser (``arguments`` a dict or JSON text)."""
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
    call_id = getattr(call, "id", None) or f"call_{uuid.uuid4().hex[:24]}"
    return ToolCall(id=call_id, name=call.name, arguments=arguments)


class OutputAssembler:
    """Turns one choice's worker events into text, tool calls and usage.

    ``plan`` is a :class:`~musegl_core.service.prepare.Plan`. The channel
    parser splits the output into reasoning, visible content and
    tool-addressed text; tool-addressed text goes to the tool parser when
    tools are active. Hidden reasoning is still parsed (and counted), it is
    only not returned. ``ids`` collects the generated ids in order, as the
    worker reported them.
    """

    def __init__(self, plan: Any, tool_parser: Any = None):
        self.plan = plan
        self.raw = getattr(plan, "raw", False)  # a raw prompt's output: the decoded text, no channels
        self.parser = None if self.raw else channels.ChannelParser(tools_active=plan.tools_active,
                                                                   hide_reasoning=False)
        self.tools = (
            tool_parser.create(list(plan.tools), {"aliases": plan.tool_aliases, "prepared": plan.prepared_tools})
            if plan.tools_active and tool_parser is not None
            else None
        )
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.ids: list[int] = []
        self.logprobs = (
            LogprobTracker(plan.tokenizer, plan.tools_active, plan.logprobs)
            if plan.logprobs >= 0 and plan.tokenizer is not None
            else None
        )
        self._sent = (0, 0)  # logprob entries already handed out (content, reasoning)

    def feed(self, event: m.Tokens) -> Output:
        """Parse the text of one ``Tokens`` event; returns the visible deltas."""
        self.ids.extend(event.ids)
        if self.logprobs is not None:
            self.logprobs.feed(event.ids, event.logprobs, event.text, self.plan.ignore_eos)
        if self.raw:
            self.content.append(event.text)
            return Output(content=event.text)
        return self._visible(self._route(self.parser.feed(event.text)))

    def logprob_entries(self, unsent: bool = False) -> LogprobEntries | None:
        """The choice's logprob entries (``unsent``: only those not handed out
        yet); None when the request did not ask for logprobs."""
        if self.logprobs is None:
            return None
        content, reasoning = self.logprobs.content, self.logprobs.reasoning
        if unsent:
            sent_c, sent_r = self._sent
            self._sent = (len(content), len(reasoning))
            content, reasoning = content[sent_c:], reasoning[sent_r:]
        return LogprobEntries(tuple(content), tuple(reasoning))

    def finish(self, done: m.Done) -> tuple[Output, str]:
        """Flush the parsers at the end of generation; returns the last deltas
        and the finish reason (``stop``, ``length``, ``tool_calls``). A failed
        tool-call set raises :class:`~musegl_core.errors.ApiError`."""
        if done.generated_ids is not None and len(done.generated_ids) >= len(self.ids):
            self.ids = list(done.generated_ids)  # ids held back with the stop check arrive here
        end = end_of_generation(done)
        if self.logprobs is not None:
            self.logprobs.finish(end)
        reason = "length" if done.finish_reason == "length" else "stop"
        if self.raw:
            return Output(), reason
        out = self._route(self.parser.finish(end), at_end=True)
        if self.tools is not None:
            self.calls = [tool_call(call) for call in self.tools.finish(end) or []]
            if not getattr(self.plan, "parallel_tool_calls", True):
                del self.calls[1:]  # parallel_tool_calls false: the turn's first call only
            if self.calls:
                reason = "tool_calls"
        return self._visible(out), reason

    def usage(self, done: m.Done) -> Usage:
        """The choice's usage. ``reasoning_tokens`` only from the exact
        generated ids: None when the worker did not report them (a
        stop-trimmed turn) and with ``ignore_eos``."""
        reasoning = None
        if done.generated_chars is not None and not self.plan.ignore_eos and not self.raw:
            reasoning = reasoning_tokens(self.parser.message_starts, done.generated_chars)
        return Usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens, reasoning)

    def _route(self, events: list[Any], at_end: bool = False) -> Output:
        """Split channel events into text and tool events; tool events go to
        the tool parser (``at_end``: they were settled by the end of output)."""
        out = Output()
        for event in events:
            if isinstance(event, channels.ReasoningDelta):
                out.reasoning += event.text
            elif isinstance(event, channels.ContentDelta):
                out.content += event.text
            elif isinstance(event, (channels.ToolDelta, channels.ToolMessageEnd)) and self.tools is not None:
                self.tools.feed(event, at_end=at_end)
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        return out

    def _visible(self, out: Output) -> Output:
        return Output("", out.content) if self.plan.hide_reasoning else out

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def content_text(self) -> str:
        return "".join(self.content)

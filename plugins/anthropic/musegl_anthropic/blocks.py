"""The service's typed events → Anthropic content blocks and stream events.

:class:`BlockWriter` is fed the events of one generation
(:mod:`musegl_core.service.events`) and keeps one block open at a time, in
output order:

* reasoning opens a ``thinking`` block (``thinking_delta``; with display
  ``omitted`` no text, only the block); when the block ends (visible text,
  a tool call or the end follows), its ``signature_delta`` carries the seal of
  the exact generated ids of its reasoning messages
  (:mod:`musegl_core.service.reasoning_seal`; an empty signature when they
  cannot be sealed, as for reasoning cut off by ``max_tokens``);
* visible text opens a ``text`` block (``text_delta``);
* each validated tool call is a ``tool_use`` block (id ``toolu_…``, its
  whole ``input`` as one ``input_json_delta``: musegl validates a call set
  as a whole before showing any of it);
* the finish gives ``stop_reason`` (``end_turn``, ``stop_sequence`` with the
  matched ``stop_sequence``, ``max_tokens``, ``model_context_window_exceeded``
  when the context budget ran out first, ``tool_use``) and the usage.

The same writer builds the non-streaming message (:meth:`BlockWriter.message`),
so a streamed and an unstreamed answer are the same blocks.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from musegl_core.service import events as ev
from musegl_core.service.reasoning_seal import reasoning_block
from musegl_anthropic import schemas as a


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage_of(usage: ev.Usage | None, prompt: tuple[int, int] = (0, 0)) -> a.Usage:
    """Anthropic's usage from the service's (or, before it is known, from the
    admitted ``(prompt_tokens, cached_tokens)``)."""
    if usage is None:
        total, cached = prompt
        return a.Usage(input_tokens=total - cached, output_tokens=0, cache_read_input_tokens=cached)
    return a.Usage(input_tokens=usage.prompt_tokens - usage.cached_tokens, output_tokens=usage.completion_tokens,
                   cache_read_input_tokens=usage.cached_tokens)


def stop_reason(finish: ev.Finish) -> tuple[str, str | None]:
    if finish.reason == "tool_calls":
        return "tool_use", None
    if finish.end == "length":
        return ("model_context_window_exceeded" if finish.context_full else "max_tokens"), None
    if finish.end == "stop" and finish.matched_stop is not None:
        return "stop_sequence", finish.matched_stop
    return "end_turn", None


class BlockWriter:
    """One response's blocks (see the module docstring).

    ``output`` is the choice's :class:`~musegl_core.service.output.OutputAssembler`
    (its generated ids and message channels are what the seal covers);
    ``seal`` the server's :class:`~musegl_core.service.reasoning_seal.ReasoningSeal`.
    """

    def __init__(self, *, message_id: str, model: str, output: Any, seal: Any, tokenizer: Any,
                 omit_thinking_text: bool = False, safeguards: tuple[str, ...] = ()):
        self.message_id = message_id
        self.model = model
        self.output = output
        self.seal = seal
        self.tokenizer = tokenizer
        self.omit_thinking_text = omit_thinking_text
        # no safety classifier runs here: each safeguard asked for is answered "unsupported"
        self.safeguard_results = [{"type": kind, "status": {"type": "unsupported"}} for kind in safeguards] or None
        self.blocks: list[Any] = []
        self._open: str | None = None  # kind of the open block
        self._text: list[str] = []  # text of the open text or thinking block
        self._sealed_through = 0
        self._calls: dict[int, tuple[str, str, list[str]]] = {}
        self.prompt = (0, 0)  # (prompt_tokens, cached_tokens) once admitted
        self.usage: ev.Usage | None = None
        self.stop: tuple[str, str | None] | None = None

    # -- the stream ---------------------------------------------------------------------
    def start(self) -> a.MessageStart:
        """``message_start``: the message with no content yet and the prompt's counts."""
        return a.MessageStart(a.Message(self.message_id, self.model, [], None, None, usage_of(None, self.prompt)))

    def feed(self, event: Any) -> list[Any]:
        """The stream events ``event`` settles (attrs objects of :mod:`musegl_anthropic.schemas`)."""
        if isinstance(event, (ev.Admitted, ev.Started)):
            self.prompt = (event.prompt_tokens, event.cached_tokens)
            return []
        if isinstance(event, ev.ReasoningDelta):
            out = self._switch("thinking")
            self._text.append(event.text)
            if not self.omit_thinking_text:
                out.append(a.ContentBlockDelta(self._index, a.ThinkingDelta(event.text)))
            return out
        if isinstance(event, ev.ContentDelta):
            out = self._switch("text")
            self._text.append(event.text)
            return out + [a.ContentBlockDelta(self._index, a.TextDelta(event.text))]
        if isinstance(event, ev.ToolCallStart):
            out = self._close()
            self._calls[event.index] = (tool_use_id(), event.name, [])
            self._open = "tool_use"
            self.blocks.append(None)  # filled at ToolCallEnd
            call_id, name, _ = self._calls[event.index]
            return out + [a.ContentBlockStart(self._index, a.ToolUseBlock(call_id, name, {}))]
        if isinstance(event, ev.ToolCallArgumentsDelta):
            self._calls[event.index][2].append(event.arguments)
            return [a.ContentBlockDelta(self._index, a.InputJsonDelta(event.arguments))]
        if isinstance(event, ev.ToolCallEnd):
            call_id, name, pieces = self._calls[event.index]
            self.blocks[self._index] = a.ToolUseBlock(call_id, name, json.loads("".join(pieces) or "{}"))
            self._open = None
            return [a.ContentBlockStop(self._index)]
        if isinstance(event, ev.UsageReport):
            self.usage = event.usage
            return []
        if isinstance(event, ev.Finish):
            out = self._close()
            self.stop = stop_reason(event)
            reason, sequence = self.stop
            return out + [a.MessageDelta(a.StopDelta(reason, sequence, self.safeguard_results),
                                         usage_of(self.usage, self.prompt)),
                          a.MessageStop()]
        return []

    def message(self) -> a.Message:
        """The whole message (non-streaming), once :class:`Finish` was fed."""
        reason, sequence = self.stop or (None, None)
        return a.Message(self.message_id, self.model, list(self.blocks), reason, sequence,
                         usage_of(self.usage, self.prompt), safeguard_results=self.safeguard_results)

    # -- blocks -------------------------------------------------------------------------
    @property
    def _index(self) -> int:
        return len(self.blocks) - 1

    def _switch(self, kind: str) -> list[Any]:
        if self._open == kind:
            return []
        out = self._close()
        self._open = kind
        block = a.ThinkingBlock("", "") if kind == "thinking" else a.TextBlock("")
        self.blocks.append(block)
        return out + [a.ContentBlockStart(self._index, block)]

    def _close(self) -> list[Any]:
        kind, text = self._open, "".join(self._text)
        if kind is None or kind == "tool_use":
            return []
        self._open, self._text = None, []
        out: list[Any] = []
        if kind == "thinking":
            signature = self._signature(text)
            out.append(a.ContentBlockDelta(self._index, a.SignatureDelta(signature)))
            self.blocks[self._index] = a.ThinkingBlock("" if self.omit_thinking_text else text, signature)
        else:
            self.blocks[self._index] = a.TextBlock(text)
        return out + [a.ContentBlockStop(self._index)]

    def _signature(self, text: str) -> str:
        channels = [channel for _, channel in self.output.parser.message_starts]
        found = reasoning_block(self.output.ids, channels, sealed_through=self._sealed_through, text=text,
                                tokenizer=self.tokenizer)
        if found is None:
            return ""
        sealed, self._sealed_through = found
        return self.seal.seal(sealed)

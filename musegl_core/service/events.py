"""What a generation reports to an API surface: typed events, one stream per response.

:meth:`musegl_core.service.generation.Generation.events` yields these, in
output order. Every event names its ``choice`` (0 unless the request asked
for several, ``n`` > 1). For one choice the order is:

* :class:`Admitted` once (the worker accepted the request: exact prompt and
  cached counts are known; prefill may still be running), then
  :class:`Started` once (prefill is done, the first token is sampled);
* :class:`ReasoningDelta` / :class:`ContentDelta` as text arrives (a worker
  batch yields at most one of each, reasoning first);
* at the end: the tool calls, each as :class:`ToolCallStart`,
  :class:`ToolCallArgumentsDelta` (the whole JSON arguments: a call set is
  validated as a whole before any of it is shown, docs/protocol.md) and
  :class:`ToolCallEnd`; then :class:`UsageReport` and :class:`Finish`.

A failure ends the whole response with one :class:`Failure` (the other
choices are cancelled); nothing follows it.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from musegl_core.errors import ApiError


@attrs.frozen
class Usage:
    """Token accounting of one choice, in the worker's own terms.

    ``prompt_tokens`` counts every prompt position (BOS and image rows
    included), ``cached_tokens`` those reused from a session, a snapshot or
    the prefix cache. ``reasoning_tokens`` is counted from the exact generated
    ids; None when they are not known (a stop-trimmed turn, ``ignore_eos``).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Admitted:
    """The worker admitted the request: its prompt is tokenized and its reusable
    prefix attached. ``prompt_tokens``/``cached_tokens`` are final."""

    choice: int
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class Started:
    """Prefill is done; generated text follows."""

    choice: int
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class ReasoningDelta:
    """Reasoning text (also produced when the surface hides reasoning: it
    decides what to show; ``Generation.hide_reasoning`` says what was asked)."""

    choice: int
    text: str
    logprobs: Any = None


@attrs.frozen
class ContentDelta:
    """Visible answer text. ``logprobs`` (on the first delta of a worker
    batch, when the request asked for them): the batch's
    :class:`~musegl_core.service.output.LogprobEntries`."""

    choice: int
    text: str
    logprobs: Any = None


@attrs.frozen
class ToolCallStart:
    """A validated tool call opens: ``index`` within the choice's call set,
    ``id`` (``call_…`` unless the tool parser gave one), ``name`` as declared."""

    choice: int
    index: int
    id: str
    name: str


@attrs.frozen
class ToolCallArgumentsDelta:
    """Arguments of call ``index`` as JSON text (a JSON object)."""

    choice: int
    index: int
    arguments: str


@attrs.frozen
class ToolCallEnd:
    choice: int
    index: int


@attrs.frozen
class UsageReport:
    choice: int
    usage: Usage


@attrs.frozen
class Finish:
    """The choice ended.

    ``reason``: ``stop`` (end of turn or a request stop), ``length`` or
    ``tool_calls`` (Chat Completions' vocabulary). ``end``: how generation
    ended, ``eos`` | ``stop`` (``matched_stop`` holds the request stop that
    matched) | ``length`` | ``cancel``. ``context_full``: a ``length`` end
    caused by the context budget rather than the request's token limit.
    """

    choice: int
    reason: str
    end: str
    matched_stop: str | None = None
    context_full: bool = False
    logprobs: Any = None  # logprob entries not handed out with a delta (when asked for)


@attrs.frozen
class Failure:
    """The response failed (before or after output began); the last event."""

    error: ApiError


GenerationEvent = Union[
    Admitted, Started, ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd,
    UsageReport, Finish, Failure,
]

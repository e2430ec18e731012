"""What a running request reports: the events the engine emits.

The worker frames them onto the pipe (:mod:`musegl_core.worker.messages`);
the front turns them into HTTP responses.
"""

from __future__ import annotations

import attrs

from musegl_core.engine.errors import EngineError
from musegl_core.engine.executor import TokenLogprobs
from musegl_core.engine.prefix_miss import PrefixMiss


@attrs.frozen
class Admitted:
    """The request is admitted and placed on its session: ``prompt_tokens``
    (after generated-token replay) and ``cached_tokens`` (positions reused) are
    final; prefill starts now."""

    id: str
    prompt_tokens: int
    cached_tokens: int = 0
    #: why fewer positions were reused than the server held for this prompt (engine/prefix_miss.py)
    prefix_miss: PrefixMiss | None = None


@attrs.frozen
class Started:
    """Generation is ready: the prompt is prefilled (headers may be sent)."""

    id: str
    prompt_tokens: int
    cached_tokens: int = 0
    #: seconds the request waited in the worker's admission queue before it ran
    queue_seconds: float = 0.0


@attrs.frozen
class Tokens:
    """Newly generated token ids and the text they completed (special tokens
    written out; EOS excluded; text held back while it may start a stop).

    ``ids`` holds every id generated since the previous ``Tokens`` event, so
    the ids of all events concatenated are the generated ids (up to those
    still held back when generation ends, which ``Done.generated_ids`` has).
    ``logprobs`` has one entry per id when the request asked for them."""

    id: str
    ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] = ()


@attrs.frozen
class Done:
    id: str
    finish_reason: str  # "stop" | "length" | "cancelled"
    matched_stop: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    generated_ids: tuple[int, ...] | None = None  # None when stop-trimmed
    #: per generated id, the characters the detokenizer added when it arrived (None with generated_ids)
    generated_chars: tuple[int, ...] | None = None
    drafted_tokens: int = 0  # speculative decoding: drafts proposed and accepted
    accepted_tokens: int = 0


@attrs.frozen
class Failed:
    """The request failed (or, with ``id`` None, a frame did): ``error`` says what
    happened, as an error kind and its details (:mod:`musegl_core.engine.errors`);
    the front gives it its status and message (:mod:`musegl_core.worker.errors`)."""

    id: str | None
    error: EngineError

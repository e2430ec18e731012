"""The wire shapes of the Responses API as musegl reads and writes them.

Requests are structured strictly (:func:`musegl_core.http.schemas.structure_body`):
a key this surface does not know is a 400 naming it, never ignored.
``input``, ``tools`` and ``tool_choice`` stay raw JSON here and are checked by
:mod:`musegl_responses.items` and :mod:`musegl_responses.tools` with errors
naming the item. Response objects and stream events are plain JSON built by
:mod:`musegl_responses.output`; the classes below document them in
``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

import attrs

from musegl_core.http import schemas as s

_ANY_INPUT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}


@s.closed
@attrs.frozen
class ReasoningParam:
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the deprecated spelling of summary


@s.closed
@attrs.frozen
class TextParam:
    format: dict[str, Any] | None = None
    verbosity: str | None = None


@s.closed
@attrs.frozen
class StreamOptionsParam:
    include_obfuscation: bool | None = None


@s.closed
@attrs.frozen
class ResponseRequest:
    """A ``POST /v1/responses`` body (and ``/v1/responses/input_tokens``'s, which
    takes the same fields). ``top_k``, ``seed``, ``min_p``, ``repetition_penalty``,
    ``presence_penalty``, ``frequency_penalty`` are musegl's sampling extensions."""

    model: str | None = None
    input: Any = attrs.field(default=None, metadata={s.JSON_SCHEMA: _ANY_INPUT})
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = attrs.field(default=None, metadata={s.JSON_SCHEMA: {}})
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: ReasoningParam | None = None
    text: TextParam | None = None
    max_output_tokens: int | None = None
    truncation: str | None = None
    include: list[str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    #: musegl's (vLLM's) prefix-cache isolation; the Responses API has no field of its own for it
    #: (``prompt_cache_key`` routes and names a conversation, it isolates nothing)
    cache_salt: str | None = s.cache_salt_field()
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    conversation: Any = attrs.field(default=None, metadata={s.JSON_SCHEMA: {}})
    prompt: Any = attrs.field(default=None, metadata={s.JSON_SCHEMA: {}})
    stream: bool | None = None
    stream_options: StreamOptionsParam | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    top_k: int | None = None
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


@attrs.frozen
class InputTokensDetails:
    cached_tokens: int
    cache_write_tokens: int  # always 0: musegl does not count cache writes apart


@attrs.frozen
class OutputTokensDetails:
    reasoning_tokens: int


@attrs.frozen
class ResponseUsage:
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


@attrs.frozen
class ResponseErrorObject:
    code: str
    message: str


@attrs.frozen
class ResponseObject:
    """The response object (``object: "response"``): the non-streaming body,
    ``GET /v1/responses/{id}`` and the ``response`` of every lifecycle event."""

    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    error: ResponseErrorObject | None
    incomplete_details: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float
    truncation: str
    metadata: dict[str, str]
    prompt_cache_key: str | None
    prompt_cache_retention: str | None = None  # the residency granted (docs/sessions.md "Retention")


@attrs.frozen
class InputTokens:
    """``POST /v1/responses/input_tokens``: the prompt's token count."""

    object: str
    input_tokens: int


@attrs.frozen
class InputItemList:
    object: str
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@attrs.frozen
class DeletedResponse:
    id: str
    object: str
    deleted: bool


@attrs.frozen
class ErrorObject:
    message: str
    type: str
    param: str | None
    code: str | None


@attrs.frozen
class ErrorBody:
    """OpenAI's error envelope."""

    error: ErrorObject

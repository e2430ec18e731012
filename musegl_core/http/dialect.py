"""API dialects: where the OpenAI and OpenRouter wire formats differ.

:class:`Dialect` is the core's ``openai`` dialect. Everything where the OpenAI and
OpenRouter wire formats differ goes through one of its methods, so
the ``openrouter`` plugin subclasses it and overrides only those:

* :meth:`adapt_request`: request fields only this dialect accepts (5.3's
  ``usage: {"include": true}``), rewritten into core fields;
* :meth:`error_body`: the JSON body of an error response;
* :meth:`stream_error`: the SSE events for an error after headers;
* :meth:`stream_tail`: where stream usage goes (5.2 / 5.3);
* :meth:`reasoning_fields`: which field names carry reasoning text (9);
* :meth:`model_entry`: the ``/v1/models`` entry (1);
* :attr:`keepalive`: the SSE comment sent while a stream is idle.

All methods build :mod:`musegl_core.http.schemas` objects or plain payloads
that :func:`~musegl_core.http.schemas.to_json` turns into JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from musegl_core.errors import ApiError
from musegl_core.http import schemas as s
from musegl_core.http import sse

if TYPE_CHECKING:  # the core's Chat Completions shapes, in annotations only
    from musegl_core.openai import schemas as oa


@attrs.frozen
class ServedModel:
    """What a dialect needs to describe the served model."""

    name: str
    created: int
    context_length: int
    demo: bool = False
    backend: str | None = None
    tool_calling: bool = False  # a --tool-parser is configured
    vision: bool = False  # a vision projector is loaded: the model reads images

    @property
    def input_modalities(self) -> tuple[str, ...]:
        return ("text", "image") if self.vision else ("text",)


class Dialect:
    """The ``openai`` dialect (OpenAI Chat Completions)."""

    name = "openai"
    keepalive: bytes = sse.comment("keepalive")

    # -- requests ----------------------------------------------------------------------
    def adapt_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Rewrite this dialect's request extensions into core fields.

        Called with the raw JSON body before the core type-checks it, so an
        extension is accepted only by the dialect that owns it and the core
        sees one vocabulary. Return the (possibly new) body, or raise
        :class:`~musegl_core.errors.ApiError` (400) for a malformed extension.
        The openai dialect has none: unknown keys are ignored.
        """
        return payload

    # -- errors ------------------------------------------------------------------------
    def error_body(self, error: ApiError) -> dict[str, Any]:
        """``{"error": {message, type, param, code}}`` (OpenAI's shape)."""
        return s.to_json(s.ErrorBody(s.ErrorObject(error.message, error.type, error.param, error.code)))

    def error_headers(self, error: ApiError) -> dict[str, str]:
        """Response headers that go with an error (``Retry-After``)."""
        return {"Retry-After": str(error.retry_after)} if error.retry_after is not None else {}

    def stream_error(self, error: ApiError, chunk: oa.ChatCompletionChunk) -> list[bytes]:
        """The events that end a stream whose headers are already out.

        ``chunk`` is an empty chunk of this stream (id, created, model) for
        dialects that wrap the error in one. The openai dialect sends
        ``data: {"error": {...}}`` and then ``data: [DONE]``.
        """
        return [sse.data_event(self.error_body(error)), sse.DONE]

    # -- streaming usage ---------------------------------------------------------------
    def stream_tail(
        self, finish: oa.ChatCompletionChunk, usage: oa.Usage | None
    ) -> list[oa.ChatCompletionChunk]:
        """The chunks that close a stream after its content.

        ``finish`` is the finish chunk (empty delta with ``finish_reason``);
        ``usage`` is set when the client asked for ``include_usage``. OpenAI
        sends usage in a separate chunk with ``choices: []``.
        """
        if usage is None:
            return [finish]
        return [finish, attrs.evolve(finish, choices=[], usage=usage)]

    # -- reasoning ---------------------------------------------------------------------
    def reasoning_fields(self, text: str | None) -> dict[str, str | None]:
        """Keyword arguments that put reasoning ``text`` on a message or delta.

        Both dialects use ``reasoning_content``; the openrouter
        dialect adds ``reasoning`` with the same text.
        """
        return {"reasoning_content": text}

    # -- models ------------------------------------------------------------------------
    def model_entry(self, model: ServedModel) -> Any:
        """The single ``/v1/models`` entry: the runtime context budget under both
        ``context_length`` and ``max_model_len``; the demo model says what it is.

        Any attrs object :func:`~musegl_core.http.schemas.to_json` can write may
        be returned; a dialect with a richer model shape returns its own class."""
        return s.ModelEntry(
            id=model.name,
            created=model.created,
            display_name=model.name,
            created_at=s.rfc3339(model.created),
            context_length=model.context_length,
            max_model_len=model.context_length,
            input_modalities=list(model.input_modalities),
            demo=True if model.demo else None,
            description=(
                "Built-in random-weight demo checkpoint: its output is noise. "
                "Start `musegl serve` with a model path to serve a real model."
                if model.demo
                else None
            ),
        )

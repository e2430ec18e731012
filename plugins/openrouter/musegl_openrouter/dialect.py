"""The ``openrouter`` dialect: OpenRouter's wire format, tuned for Muse agent clients.

:class:`OpenRouterDialect` subclasses the core's ``openai``
:class:`~musegl_core.http.dialect.Dialect` and overrides only where
the two wire formats differ:

* requests: the legacy switch ``usage: {"include": true}`` is an alias of
  ``stream_options.include_usage``;
* stream usage rides on the finish chunk, exactly once, with no usage-only
  chunk after it: the Muse provider stops reading at the finish chunk;
* errors: ``{"error": {"code": <HTTP status>, "message", "metadata":
  {"error_code", ...}}}``; after headers, a chunk with a top-level
  ``error`` and ``finish_reason: "error"`` that ends the stream;
* context overflows: a message that reactive-compaction clients parse, with
  the counts in ``metadata`` (see :mod:`musegl_openrouter.overflow`);
* reasoning text is returned as ``reasoning_content`` and as ``reasoning``;
* ``/v1/models``: OpenRouter's model shape (:mod:`musegl_openrouter.models`);
* keepalives read ``: OPENROUTER PROCESSING`` as OpenRouter's own do.
"""

from __future__ import annotations

from typing import Any

import attrs

from musegl_core.errors import ApiError, bad_request
from musegl_core.http.schemas import to_json
from musegl_core.openai import schemas as s
from musegl_core.http import sse
from musegl_core.http.dialect import Dialect, ServedModel
from musegl_openrouter.models import OpenRouterModel
from musegl_openrouter.overflow import CONTEXT_LENGTH_EXCEEDED, OverflowCounts, overflow_message

#: The keys of OpenRouter's legacy ``usage`` request object.
USAGE_KEYS = frozenset({"include"})


class OpenRouterDialect(Dialect):
    """OpenRouter's Chat Completions wire format."""

    name = "openrouter"
    keepalive: bytes = sse.comment("OPENROUTER PROCESSING")

    # -- requests ----------------------------------------------------------------------
    def adapt_request(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Fold ``usage: {"include": bool}`` into ``stream_options.include_usage``.

        ``null`` (or ``{"include": null}``) is absent; other keys, a non-boolean
        ``include`` and a value that contradicts an explicit
        ``stream_options.include_usage`` are 400s naming the field.
        """
        if "usage" not in payload:
            return payload
        usage = payload["usage"]
        if usage is None:
            return {key: value for key, value in payload.items() if key != "usage"}
        if not isinstance(usage, dict):
            raise bad_request("'usage' has the wrong type: expected an object such as {\"include\": true}", param="usage")
        unknown = sorted(set(usage) - USAGE_KEYS)
        if unknown:
            param = f"usage.{unknown[0]}"
            raise bad_request(f"'{param}' is not a supported parameter", code="unsupported_parameter", param=param)
        adapted = {key: value for key, value in payload.items() if key != "usage"}
        include = usage.get("include")
        if include is None:
            return adapted
        if not isinstance(include, bool):
            raise bad_request("'usage.include' has the wrong type: expected a boolean", param="usage.include")
        options = payload.get("stream_options")
        if options is None:
            options = {}
        if not isinstance(options, dict):
            return adapted  # the core reports the malformed stream_options
        current = options.get("include_usage")
        if current is None:
            adapted["stream_options"] = {**options, "include_usage": include}
        elif current is not include and isinstance(current, bool):
            raise bad_request(
                f"'usage.include' ({str(include).lower()}) contradicts "
                f"'stream_options.include_usage' ({str(current).lower()}); send one",
                param="usage.include",
            )
        return adapted

    # -- errors ------------------------------------------------------------------------
    def error_body(self, error: ApiError) -> dict[str, Any]:
        """``{"error": {"code": <status>, "message", "metadata"}}``.

        ``metadata.error_code`` keeps musegl's string code (the error type when
        there is none), ``error_type`` the OpenAI category and ``param`` the
        offending field; the error's own metadata (overflow counts) follows.
        """
        metadata: dict[str, Any] = {"error_code": error.code or error.type, "error_type": error.type}
        if error.param is not None:
            metadata["param"] = error.param
        metadata.update(error.metadata)
        message = error.message
        if error.code == CONTEXT_LENGTH_EXCEEDED:
            message = overflow_message(OverflowCounts.from_metadata(error.metadata))
        return {"error": {"code": error.status, "message": message, "metadata": metadata}}

    def stream_error(self, error: ApiError, chunk: s.ChatCompletionChunk) -> list[bytes]:
        """One chunk of this stream with a top-level ``error`` and
        ``finish_reason: "error"``; the stream ends after it (no ``[DONE]``)."""
        failed = attrs.evolve(chunk, choices=[s.ChunkChoice(delta=s.Delta(content=""), finish_reason="error")])
        payload = to_json(failed)
        payload["error"] = self.error_body(error)["error"]
        return [sse.data_event(payload)]

    # -- streaming usage ---------------------------------------------------------------
    def stream_tail(
        self, finish: s.ChatCompletionChunk, usage: s.Usage | None
    ) -> list[s.ChatCompletionChunk]:
        """The finish chunk, carrying ``usage`` when the client asked for it."""
        return [finish if usage is None else attrs.evolve(finish, usage=usage)]

    # -- reasoning ---------------------------------------------------------------------
    def reasoning_fields(self, text: str | None) -> dict[str, str | None]:
        """``reasoning_content`` and OpenRouter's ``reasoning``, with the same text."""
        return {"reasoning_content": text, "reasoning": text}

    # -- models ------------------------------------------------------------------------
    def model_entry(self, model: ServedModel) -> OpenRouterModel:
        """OpenRouter's model shape around the runtime context budget."""
        return OpenRouterModel.describe(model, super().model_entry(model))

"""The Messages API surface: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Both paths also answer with ``?beta=true`` (Claude Code always adds it; the
query changes nothing). The API key may come as ``x-api-key`` (the SDKs' and
Claude Code's ``ANTHROPIC_API_KEY``) or ``Authorization: Bearer``
(``ANTHROPIC_AUTH_TOKEN``); ``anthropic-version`` and ``anthropic-beta``
headers are accepted whatever their values.

A stream sends its headers once the worker has admitted the request (so
``message_start`` carries the exact ``input_tokens`` and
``cache_read_input_tokens``), then ``ping`` events while the prompt is
prefilled and whenever the stream is idle for :data:`PING_INTERVAL` seconds
(Claude Code gives up on a stream silent for 90 s; SSE comments do not count
for it). Errors found before the headers are ordinary HTTP errors in
Anthropic's envelope (:mod:`musegl_anthropic.errors`); after them, an
``error`` event ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from litestar import Request, Response, post
from litestar.connection import ASGIConnection
from litestar.openapi.spec import Parameter, Schema
from litestar.response import Stream

from musegl_core.errors import ApiError
from musegl_core.http import openapi
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http.offload import off_loop
from musegl_core.http.request_log import stream_failed
from musegl_core.http.surface import ApiSurface, unless_disconnected
from musegl_core.service import events as ev
from musegl_core.service.retention import retention_header
from musegl_core.service.sessions import peer_key, session_echo
from musegl_anthropic import errors
from musegl_anthropic import schemas as a
from musegl_anthropic.blocks import BlockWriter
from musegl_anthropic.request import MessagesCall, no_vision, read_request

log = logging.getLogger("musegl.anthropic")

PING_INTERVAL = 10.0
API_KEY_HEADER = Parameter(name="x-api-key", param_in="header", required=False,
                                   schema=Schema(type="string"),  # type: ignore[arg-type]
                                   description="the server's --api-key (or Authorization: Bearer)")
SESSION_HEADER = Parameter(
    name="X-Claude-Code-Session-Id", param_in="header", required=False,
    schema=Schema(type="string"),  # type: ignore[arg-type]
    description="the client's conversation key: the request runs in a soft session of that name")


def event(payload: Any) -> bytes:
    """One SSE event named by the payload's ``type``."""
    data = s.to_json(payload)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {data['type']}\ndata: {text}\n\n".encode()


PING = event(a.Ping())


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


class MessagesSurface(ApiSurface):
    """Anthropic Messages over the generation service."""

    name = "anthropic"
    title = "Anthropic Messages"
    prefixes = ("/v1/messages",)

    # -- envelope and credentials ------------------------------------------------------------
    def error_body(self, error: ApiError) -> Any:
        return s.to_json(errors.envelope(error))

    def error_status(self, error: ApiError) -> int:
        return errors.status_of(error)

    def error_headers(self, error: ApiError) -> dict[str, str]:
        return {"retry-after": str(error.retry_after)} if error.retry_after is not None else {}

    def credential(self, connection: ASGIConnection) -> str | None:
        key = connection.headers.get("x-api-key")
        return key if key is not None else super().credential(connection)

    def credential_error(self) -> ApiError:
        return ApiError(401, "a valid API key is required (x-api-key or Authorization: Bearer)",
                        "authentication_error", "invalid_api_key")

    # -- routes ----------------------------------------------------------------------------
    def routes(self) -> list:
        surface = self
        error_codes = {code: errors.ErrorEnvelope for code in (400, 401, 413, 529)}

        @post("/v1/messages", status_code=200, operation_class=openapi.operation(
            body=a.MessagesRequest,
            responses={200: {"application/json": a.Message, "text/event-stream": openapi.SSE}, **error_codes},
            headers=(API_KEY_HEADER, SESSION_HEADER)))
        async def messages(request: Request) -> Response:
            """Generate a message (JSON, or an SSE stream with ``stream: true``)."""
            return await surface.create(request)

        @post("/v1/messages/count_tokens", status_code=200, operation_class=openapi.operation(
            body=a.MessagesRequest, responses={200: a.TokenCount, **error_codes}, headers=(API_KEY_HEADER,)))
        async def count_tokens(request: Request) -> Response:
            """The prompt's token count, as ``/v1/messages`` would tokenize it."""
            return await surface.count(request)

        return [messages, count_tokens]

    # -- handlers --------------------------------------------------------------------------
    def _read(self, body: bytes, headers: Any, counting: bool) -> MessagesCall:
        payload = s.parse_body(body)
        request = s.structure_body(payload, a.MessagesRequest)
        call = read_request(request, headers=headers, seal=self.context.seal,
                            tokenizer=self.context.service.tokenizer, counting=counting)
        if call.image_at is not None and not self.context.served_model.vision:
            raise no_vision(call.image_at)
        return call

    async def create(self, request: Request) -> Response:
        arrived = time.monotonic()
        context = self.context
        context.check_open()
        body = await request.body()
        service = context.service
        rid = message_id()

        def prepare():  # off the event loop (musegl_core.http.offload)
            call = self._read(body, request.headers, counting=False)
            return call, service.prepare(call.conversation, request_id=rid)

        call, plan = await off_loop(prepare)
        service.require_ready()
        generation = service.generation(plan, arrived=arrived, client=peer_key(request))
        echo = session_echo(plan.generate.session_id, plan.generate.soft_session)
        echo.update(retention_header(plan.generate.retention, words=str))  # Anthropic's words: 5m, 1h
        writer = BlockWriter(message_id=rid, model=call.model, output=generation.outputs[0], seal=context.seal,
                             tokenizer=service.tokenizer, omit_thinking_text=call.omit_thinking_text,
                             safeguards=call.safeguards)
        if call.safeguards:
            log.info("request %s: safeguards %s not run on this server (answered unsupported: the client "
                     "classifies its tool uses itself)", rid, ", ".join(call.safeguards))
        if not call.stream:
            message = await unless_disconnected(request, self._complete(generation, writer))
            return Response(s.to_json(message), media_type="application/json", headers=echo)
        await unless_disconnected(request, generation.open(until="admitted"))
        writer.prompt = generation.counts(0) or writer.prompt  # message_start's exact counts
        body = sse.with_keepalive(self._stream(generation, writer), PING, PING_INTERVAL)
        return Stream(body, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **echo})

    @staticmethod
    async def _complete(generation: Any, writer: BlockWriter) -> a.Message:
        await generation.open()
        try:
            async for item in generation.events():
                if isinstance(item, ev.Failure):
                    raise item.error
                writer.feed(item)
        finally:
            await generation.close()
        return writer.message()

    @staticmethod
    async def _stream(generation: Any, writer: BlockWriter) -> AsyncIterator[bytes]:
        try:
            yield event(writer.start())
            yield PING
            async for item in generation.events():
                if isinstance(item, ev.Failure):
                    stream_failed(item.error)
                    yield event(errors.envelope(item.error))
                    return
                for out in writer.feed(item):
                    yield event(out)
        finally:
            await generation.close()

    async def count(self, request: Request) -> Response:
        context = self.context
        body = await request.body()

        def prepare():  # off the event loop (musegl_core.http.offload)
            return context.service.prepare(self._read(body, request.headers, counting=True).conversation,
                                           request_id="count")

        plan = await off_loop(prepare)
        tokenizer = context.service.tokenizer
        if tokenizer is None:
            raise ApiError(503, "the tokenizer is not loaded yet", "unavailable_error", "model_loading", retry_after=1)
        count = await asyncio.to_thread(_count, plan, tokenizer, context)
        return Response(s.to_json(a.TokenCount(count)), media_type="application/json")


def _count(plan: Any, tokenizer: Any, context: Any) -> int:
    """Prompt positions exactly as the worker counts them: text ids with the BOS,
    and each image's rows (its pixels decide how many)."""
    from musegl_core.worker.prepare import prepare

    vision = None
    if plan.generate.images:
        if not context.served_model.vision:
            raise ApiError(400, "this model reads no images (it was loaded without a vision projector)",
                           "invalid_request_error", "invalid_image", "messages")
        from musegl_core.vision.preprocess import ImagePreprocessor

        vision = ImagePreprocessor(context.config.max_vision_patches)
    return len(prepare(plan.generate, tokenizer, vision=vision).prompt_ids)

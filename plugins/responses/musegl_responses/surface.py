"""The Responses API surface: routes, the error envelope, the stream, the store.

``POST /v1/responses`` plans the request (:mod:`musegl_responses.planning`),
has the generation service prepare it (template, constraints, images) and
runs it. Non-streaming, it answers the response object; streaming, it waits
until the worker has *admitted* the request (exact prompt and cached counts
known, so a prompt that cannot fit is still an ordinary error, except
``context_length_exceeded``, which a stream reports as ``response.failed``:
Codex compacts its conversation on it), then sends ``response.created``,
``response.in_progress`` (repeated every ``--responses-keepalive`` seconds
while the prompt is prefilled) and the output events of
:class:`~musegl_responses.output.ResponseBuilder`.

Stored responses (``store`` true, the default) are kept in a bounded
:class:`~musegl_responses.store.ResponseStore`; ``previous_response_id``
continues the stored conversation in the session that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, AsyncIterator

import attrs
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from musegl_core.errors import ApiError, bad_request
from musegl_core.http import openapi
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http.offload import off_loop
from musegl_core.http.request_log import stream_failed
from musegl_core.http.surface import ApiSurface, unless_disconnected
from musegl_core.service import events as ev
from musegl_core.service.retention import retention_header
from musegl_core.service.sessions import peer_key, session_echo
from musegl_core.tokenizer import TokenizationError

from musegl_responses import schemas as rs
from musegl_responses.items import Reader
from musegl_responses.output import ResponseBuilder
from musegl_responses.planning import ResponsePlan, plan_response
from musegl_responses.settings import ResponsesSettings
from musegl_responses.store import ResponseStore, StoredResponse
from musegl_responses.truncation import fit

log = logging.getLogger("musegl.responses")

_ERRORS = {400: rs.ErrorBody, 401: rs.ErrorBody, 404: rs.ErrorBody, 413: rs.ErrorBody, 503: rs.ErrorBody}
_KEEPALIVE = object()


def not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response with id {response_id!r} is stored here.", "invalid_request_error",
                    "response_not_found", "response_id")


def sse_event(body: dict[str, Any]) -> bytes:
    return f"event: {body['type']}\n".encode() + sse.data_event(body)


_END = object()
_CANCEL = object()


@attrs.define
class Running:
    """A response being generated: its builder and the queue its events pass
    through (:meth:`cancel` puts the cancel marker there)."""

    builder: ResponseBuilder
    queue: asyncio.Queue = attrs.field(factory=asyncio.Queue)

    def cancel(self) -> None:
        self.queue.put_nowait(_CANCEL)


class ResponsesSurface(ApiSurface):
    name = "responses"
    title = "Responses"
    prefixes = ("/v1/responses",)

    def __init__(self, context: Any):
        super().__init__(context)
        self.settings = ResponsesSettings.from_extra(context.config.extra)
        self.store = ResponseStore(ttl=self.settings.store_ttl, max_entries=self.settings.store_entries,
                                   max_bytes=self.settings.store_bytes)
        self.running: dict[str, Running] = {}

    def error_body(self, error: ApiError) -> Any:
        param = "input" if error.code == "context_length_exceeded" else error.param  # the core names "messages"
        return {"error": {"message": error.message, "type": error.type, "param": param, "code": error.code}}

    # -- planning ----------------------------------------------------------------------
    def reader(self) -> Reader:
        return Reader(self.context.seal, self.context.service.tokenizer)

    async def _plan(self, request: Request) -> ResponsePlan:
        raw = await request.body()

        def read():  # off the event loop (musegl_core.http.offload)
            body = s.structure_body(s.parse_body(raw), rs.ResponseRequest)
            return body, plan_response(body, headers=request.headers, store=self.store, reader=self.reader(),
                                       max_sessions=self.context.config.max_sessions,
                                       disk_tier=self.context.config.kv_offload_dir is not None)

        body, plan = await off_loop(read)
        if body.truncation == "auto":
            service = self.context.service
            fitted = await fit(plan.conversation, prepare=lambda c: service.prepare(c, request_id=plan.id),
                               tokenizer=service.tokenizer, max_context=self.context.config.max_context)
            plan = attrs.evolve(plan, conversation=fitted)
        return plan

    # -- running -------------------------------------------------------------------------
    async def _drive(self, generation: Any, builder: ResponseBuilder, running: Running) -> AsyncIterator[Any]:
        """The builder's events for the generation's events (after ``open``), plus
        :data:`_KEEPALIVE` markers while nothing arrives for ``--responses-keepalive`` s.

        A pump task moves the generation's events into ``running.queue`` (where
        ``cancel`` puts its marker), so waiting with a timeout never cancels
        the generation's own iterator."""
        queue = running.queue

        async def pump() -> None:
            try:
                async for event in generation.events():
                    queue.put_nowait(event)
            finally:
                queue.put_nowait(_END)

        task = asyncio.ensure_future(pump())
        try:
            while True:
                try:
                    async with asyncio.timeout(self.settings.keepalive):
                        event = await queue.get()
                except TimeoutError:
                    yield _KEEPALIVE
                    continue
                if event is _END:
                    await task  # re-raises what ended the pump early, if anything did
                    return
                if event is _CANCEL:
                    await generation.close()
                    for item in builder.cancelled():
                        yield item
                    return
                if isinstance(event, ev.Started):
                    builder.started = True
                elif isinstance(event, ev.Failure):
                    stream_failed(event.error)
                for item in builder.feed(event):
                    yield item
                if isinstance(event, (ev.Finish, ev.Failure)):
                    return
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await generation.close()

    def _keep(self, plan: ResponsePlan, builder: ResponseBuilder) -> None:
        """Store the finished response (``store`` true) with the conversation it ends."""
        if not plan.store:
            return
        items, sealed_items = [], iter(builder.sealed)
        for item in builder.items:
            if item["type"] == "reasoning":
                sealed = next(sealed_items, None)
                echo = {"type": "reasoning", "content": item.get("content", [])}
                if sealed is not None:
                    echo["encrypted_content"] = self.context.seal.seal(sealed)
                items.append(echo)
            elif item["type"] == "message":
                items.append({"type": "message", "role": "assistant", "content": item["content"]})
            else:
                items.append(item)
        try:
            turn = self.reader().messages(items, "output") if builder.status in ("completed", "incomplete") else []
        except ApiError:
            turn = []
        prior = list(plan.prior.messages) if plan.prior is not None else []
        entry = StoredResponse(id=plan.id, body=builder.response(), input_items=plan.input_items,
                               messages=prior + list(plan.new_messages) + turn, instructions=plan.request.instructions,
                               session=plan.session, soft=plan.soft)
        if not self.store.put(entry):
            log.info("responses: %s is too large for the response store; not stored", plan.id)

    # -- routes ----------------------------------------------------------------------------
    def routes(self) -> list:
        context = self.context
        surface = self

        @post("/v1/responses", status_code=200,
              operation_class=openapi.operation(body=rs.ResponseRequest,
                                                responses={200: {"application/json": rs.ResponseObject,
                                                                 "text/event-stream": openapi.SSE},
                                                           **_ERRORS}))
        async def create_response(request: Request) -> Response:
            """Generate a response (JSON, or SSE with ``stream: true``)."""
            arrived = time.monotonic()
            context.check_open()
            plan = await surface._plan(request)
            service = context.service
            service.require_ready()
            prepared = await off_loop(service.prepare, plan.conversation, request_id=plan.id)
            generation = service.generation(prepared, arrived=arrived, client=peer_key(request))
            echo = session_echo(prepared.generate.session_id, prepared.generate.soft_session)
            echo.update(retention_header(prepared.generate.retention))
            builder = ResponseBuilder(plan, context.served_model.name, seal=context.seal, tokenizer=service.tokenizer)
            builder.output_assembler = generation.outputs[0]
            running = Running(builder)
            if not plan.conversation.settings.stream:
                return Response(await unless_disconnected(request, surface._complete(generation, builder, running)),
                                media_type="application/json", headers=echo)
            try:
                await unless_disconnected(request, generation.open(until="admitted"))
            except ApiError as error:
                if error.code != "context_length_exceeded":
                    raise
                return Stream(surface._failed_stream(builder, error), media_type=sse.MEDIA_TYPE,
                              headers={**sse.HEADERS, **echo})
            return Stream(surface._stream(generation, builder, running), media_type=sse.MEDIA_TYPE,
                          headers={**sse.HEADERS, **echo})

        @post("/v1/responses/input_tokens", status_code=200,
              operation_class=openapi.operation(body=rs.ResponseRequest, responses={200: rs.InputTokens, **_ERRORS}))
        async def input_tokens(request: Request) -> Response:
            """The prompt's token count for a request (nothing is generated)."""
            context.check_open()
            plan = await surface._plan(request)
            service = context.service
            prepared = service.prepare(plan.conversation, request_id=plan.id)
            if prepared.image_count:
                raise bad_request("input_tokens does not count images (the worker's vision preprocessing decides "
                                  "their positions); send text only", code="unsupported_parameter", param="input")
            tokenizer = service.tokenizer
            if tokenizer is None:
                service.require_ready()
                raise ApiError(503, "the tokenizer is not loaded", "unavailable_error", "model_loading")
            try:
                ids = await asyncio.to_thread(tokenizer.encode_segments, prepared.generate.prompt,
                                              add_bos=prepared.generate.add_bos)
            except TokenizationError as exc:
                raise bad_request(f"could not tokenize the prompt: {exc}", param="input") from None
            return Response({"object": "response.input_tokens", "input_tokens": len(ids)},
                            media_type="application/json")

        @get("/v1/responses/{response_id:str}", sync_to_thread=False,
             operation_class=openapi.operation(responses={200: rs.ResponseObject, 401: rs.ErrorBody,
                                                          404: rs.ErrorBody}))
        def retrieve(request: Request, response_id: FromPath[str]) -> Response:
            """A stored response (or one still being generated)."""
            query = request.query_params
            if query.get("stream") not in (None, "false"):
                raise bad_request("replaying a response as a stream is not supported; GET it without 'stream'",
                                  code="unsupported_parameter", param="stream")
            unknown = sorted(set(query) - {"stream"})  # include: the object is kept as it was created
            if unknown:
                raise bad_request(f"unknown query parameter {unknown[0]!r}", code="unsupported_parameter",
                                  param=unknown[0])
            running = surface.running.get(response_id)
            if running is not None:
                return Response(running.builder.response(), media_type="application/json")
            entry = surface.store.get(response_id)
            if entry is None:
                raise not_found(response_id)
            return Response(entry.body, media_type="application/json")

        @delete("/v1/responses/{response_id:str}", status_code=200, sync_to_thread=False,
                operation_class=openapi.operation(responses={200: rs.DeletedResponse, 401: rs.ErrorBody,
                                                             404: rs.ErrorBody}))
        def remove(response_id: FromPath[str]) -> Response:
            """Delete a stored response."""
            if not surface.store.delete(response_id):
                raise not_found(response_id)
            return Response({"id": response_id, "object": "response.deleted", "deleted": True},
                            media_type="application/json")

        @get("/v1/responses/{response_id:str}/input_items", sync_to_thread=False,
             operation_class=openapi.operation(responses={200: rs.InputItemList, 400: rs.ErrorBody,
                                                          401: rs.ErrorBody, 404: rs.ErrorBody}))
        def list_input_items(request: Request, response_id: FromPath[str]) -> Response:
            """The input items of a stored response (``limit`` 1-100, ``order`` asc|desc, ``after``)."""
            entry = surface.store.get(response_id)
            if entry is None:
                raise not_found(response_id)
            return Response(page(entry.input_items, request.query_params), media_type="application/json")

        @post("/v1/responses/{response_id:str}/cancel", status_code=200,
              operation_class=openapi.operation(responses={200: rs.ResponseObject, 400: rs.ErrorBody,
                                                           401: rs.ErrorBody, 404: rs.ErrorBody}))
        async def cancel(response_id: FromPath[str]) -> Response:
            """Cancel a response that is still being generated."""
            running = surface.running.get(response_id)
            if running is None:
                entry = surface.store.get(response_id)
                if entry is None:
                    raise not_found(response_id)
                raise bad_request(f"the response {response_id!r} is {entry.body['status']}; only a response in "
                                  "progress can be cancelled", code="response_not_cancellable", param="response_id")
            running.cancel()
            for _ in range(200):
                if response_id not in surface.running:
                    break
                await asyncio.sleep(0.01)
            return Response(running.builder.response(), media_type="application/json")

        return [create_response, input_tokens, retrieve, remove, list_input_items, cancel]

    async def _complete(self, generation: Any, builder: ResponseBuilder, running: Running) -> dict[str, Any]:
        plan = builder.plan
        await generation.open()
        self.running[plan.id] = running
        try:
            async for item in self._drive(generation, builder, running):
                if builder.status == "failed" and builder.failure is not None:
                    self._keep(plan, builder)
                    raise builder.failure
        finally:
            self.running.pop(plan.id, None)
        if builder.status == "in_progress":  # the events ended without a finish
            raise ApiError(503, "the model worker ended the request without a result", "unavailable_error",
                           "worker_restarting")
        self._keep(plan, builder)
        return builder.response()

    async def _stream(self, generation: Any, builder: ResponseBuilder, running: Running) -> AsyncIterator[bytes]:
        plan = builder.plan
        self.running[plan.id] = running
        try:
            for item in builder.start():
                yield sse_event(item)
            async for item in self._drive(generation, builder, running):
                if item is _KEEPALIVE:
                    yield sse_event(builder.in_progress()) if not builder.started else sse.comment("keepalive")
                else:
                    yield sse_event(item)
            if builder.status == "in_progress":  # the events ended without a finish
                for item in builder.fail(ApiError(503, "the model worker ended the request without a result",
                                                  "unavailable_error", "worker_restarting")):
                    yield sse_event(item)
            self._keep(plan, builder)
        finally:
            self.running.pop(plan.id, None)

    async def _failed_stream(self, builder: ResponseBuilder, error: ApiError) -> AsyncIterator[bytes]:
        for item in builder.start():
            yield sse_event(item)
        for item in builder.fail(error):
            yield sse_event(item)
        self._keep(builder.plan, builder)


def page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """One page of ``input_items``."""
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        raise bad_request("'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise bad_request("'limit' must be between 1 and 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", param="order")
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise bad_request(f"'after' names no item of this response: {after!r}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}

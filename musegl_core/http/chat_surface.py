"""The core's own API surfaces: Chat Completions and Completions.

Both are spelled by the server's ``--api-dialect`` (``openai``, or a plugin's
such as ``openrouter``): its request extensions, error bodies, usage
placement and keepalives. The logic lives in :mod:`musegl_core.http.completions`
(Chat Completions over the generation service) and
:mod:`musegl_core.http.text_completions`; these classes are their routes.
"""

from __future__ import annotations

import time

from litestar import Request, Response, post
from litestar.response import Stream

from musegl_core.http import openapi
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http import text_completions as tc
from musegl_core.http.completions import ChatStream, ResponseMeta, complete, plan_chat
from musegl_core.http.offload import off_loop
from musegl_core.http.surface import ApiSurface, unless_disconnected
from musegl_core.service.sessions import header_keys, session_echo


class ChatCompletionsSurface(ApiSurface):
    """``POST /v1/chat/completions`` (and ``/chat/completions``)."""

    name = "chat"
    title = "Chat Completions"
    prefixes = ("/v1/chat", "/chat")

    def routes(self) -> list:
        context = self.context

        @post(["/v1/chat/completions", "/chat/completions"], status_code=200,
              operation_class=openapi.operation(body=s.ChatCompletionRequest,
                                                responses=openapi.GENERATION(s.ChatCompletion),
                                                headers=(openapi.SESSION_HEADER,)))
        async def chat_completions(request: Request) -> Response:
            """Chat generation as one JSON object or an SSE stream."""
            arrived = time.monotonic()
            context.check_open()
            service = context.service
            body = await request.body()
            served = context.served_model
            meta = ResponseMeta.new(served.name, served.backend or "unknown")

            def prepare():  # off the event loop (http/offload.py): parsing, checks, prompt, constraint
                chat = s.structure_request(context.dialect.adapt_request(s.parse_body(body)))
                return plan_chat(
                    chat,
                    request_id=meta.id,
                    config=context.config,
                    template=service.template,
                    tool_parser=service.tool_parser,
                    header_session_id=request.headers.get("x-session-id"),
                    client_keys=header_keys(request.headers),
                    tokenizer=service.tokenizer,
                )

            plan = await off_loop(prepare)
            service.require_ready()
            worker = context.metered(arrived)
            echo = session_echo(plan.generate.session_id, plan.generate.soft_session)
            if not plan.stream:
                result = await unless_disconnected(
                    request, complete(worker, plan, meta, context.dialect, service.tool_parser))
                return Response(s.to_json(result), media_type="application/json", headers=echo)
            stream = ChatStream(worker, plan, meta, context.dialect, service.tool_parser,
                                context.config.streaming_preflight_timeout)
            await unless_disconnected(request, stream.open())
            return Stream(stream.events(), media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **echo})

        return [chat_completions]


class CompletionsSurface(ApiSurface):
    """``POST /v1/completions`` (and ``/completions``): a raw prompt, no template."""

    name = "completions"
    title = "Completions"
    prefixes = ("/v1/completions", "/completions")

    def error_response(self, error):
        return super().error_response(tc.prompt_error(error))  # the input is 'prompt' here, not 'messages'

    def routes(self) -> list:
        context = self.context

        @post(["/v1/completions", "/completions"], status_code=200,
              operation_class=openapi.operation(body=s.CompletionRequest,
                                                responses=openapi.GENERATION(s.TextCompletion)))
        async def completions(request: Request) -> Response:
            """Raw-prompt generation (no chat template) as one JSON object or an SSE stream."""
            arrived = time.monotonic()
            context.check_open()
            raw = await request.body()
            served = context.served_model
            meta = tc.new_meta(served.name, served.backend or "unknown")

            def prepare():  # off the event loop (http/offload.py)
                body = s.structure_body(s.parse_body(raw), s.CompletionRequest)
                return tc.plan_completion(body, request_id=meta.id, config=context.config)

            plan = await off_loop(prepare)
            context.service.require_ready()
            worker = context.metered(arrived)
            if not plan.stream:
                result = await unless_disconnected(request, tc.complete_text(worker, plan, meta))
                return Response(s.to_json(result), media_type="application/json")
            stream = tc.TextStream(worker, plan, meta, context.dialect, context.config.streaming_preflight_timeout)
            await unless_disconnected(request, stream.open())
            return Stream(stream.events(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

        return [completions]

"""The core's own API surfaces: Chat Completions and Completions.

They are built as any plugin's surface is (docs/plugins.md): parse the body,
turn it into what the generation service takes, have the service prepare and
run it, write the service's events in this API's shapes. Both are spelled by
the server's ``--api-dialect`` (``openai``, or a plugin's such as
``openrouter``): its request extensions, error bodies, usage placement and
keepalives. The request rules and response shapes live in
:mod:`musegl_core.openai.chat` and :mod:`musegl_core.openai.completions`;
these classes are their routes.
"""

from __future__ import annotations

import time

from litestar import Request, Response, post
from litestar.response import Stream

from musegl_core.http import openapi
from musegl_core.http import sse
from musegl_core.http.offload import off_loop
from musegl_core.http.schemas import parse_body, structure_body, to_json
from musegl_core.http.surface import ApiSurface, unless_disconnected
from musegl_core.openai import completions as tc
from musegl_core.openai import schemas as s
from musegl_core.openai.chat import ChatStream, ResponseMeta, complete, read_chat
from musegl_core.openai.tokenize import detokenize, tokenize
from musegl_core.service.retention import retention_header
from musegl_core.service.sessions import explicit_header_session, header_keys, peer_key, session_echo


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

            def prepare():  # off the event loop (http/offload.py): parsing, checks, prompt, constraint preflight
                chat = s.structure_request(context.dialect.adapt_request(parse_body(body)))
                conversation, tools = read_chat(chat, config=context.config, tool_parser=service.tool_parser,
                                                header_session_id=explicit_header_session(request.headers),
                                                client_keys=header_keys(request.headers))
                return service.prepare(conversation, request_id=meta.id, tool_setup=tools)

            plan = await off_loop(prepare)
            service.require_ready()
            generation = service.generation(plan, arrived=arrived, client=peer_key(request))
            echo = session_echo(plan.generate.session_id, plan.generate.soft_session)
            echo.update(retention_header(plan.generate.retention))
            if not plan.stream:
                result = await unless_disconnected(request, complete(generation, meta, context.dialect))
                return Response(to_json(result), media_type="application/json", headers=echo)
            stream = ChatStream(generation, meta, context.dialect)
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
            service = context.service
            raw = await request.body()
            served = context.served_model
            meta = tc.new_meta(served.name, served.backend or "unknown")

            def prepare():  # off the event loop (http/offload.py)
                body = structure_body(parse_body(raw), s.CompletionRequest)
                return tc.plan_completion(body, request_id=meta.id, config=context.config, service=service)

            plan = await off_loop(prepare)
            service.require_ready()
            generation = service.generation(plan, arrived=arrived, client=peer_key(request))
            if not plan.stream:
                result = await unless_disconnected(request, tc.complete_text(generation, meta))
                return Response(to_json(result), media_type="application/json")
            stream = tc.TextStream(generation, meta, context.dialect)
            await unless_disconnected(request, stream.open())
            return Stream(stream.events(), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)

        return [completions]


class TokenizeSurface(ApiSurface):
    """``POST /tokenize`` and ``POST /detokenize`` with the served tokenizer (:mod:`musegl_core.openai.tokenize`)."""

    name = "tokenize"
    title = "Tokenize"

    def routes(self) -> list:
        context = self.context

        @post("/tokenize", status_code=200,
              operation_class=openapi.operation(body=s.TokenizeRequest, responses=openapi.PLAIN(s.TokenizeResult)))
        async def tokenize_text(request: Request) -> Response:
            """Token ids of raw text, or of a conversation rendered with the chat template."""
            body = await off_loop(lambda raw: structure_body(parse_body(raw), s.TokenizeRequest), await request.body())
            service = context.service
            result = await tokenize(body, tokenizer=service.tokenizer, template=service.template,
                                    tool_parser=service.tool_parser, config=context.config)
            return Response(to_json(result), media_type="application/json")

        @post("/detokenize", status_code=200,
              operation_class=openapi.operation(body=s.DetokenizeRequest,
                                                responses=openapi.PLAIN(s.DetokenizeResult)))
        async def detokenize_ids(request: Request) -> Response:
            """The text of token ids, special tokens written out."""
            body = await off_loop(lambda raw: structure_body(parse_body(raw), s.DetokenizeRequest),
                                  await request.body())
            result = await detokenize(body, tokenizer=context.service.tokenizer)
            return Response(to_json(result), media_type="application/json")

        return [tokenize_text, detokenize_ids]

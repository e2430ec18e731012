"""The HTTP front's server frame: the Litestar app (:mod:`.app`), the API
surface base (:mod:`.surface`), the schema kit (:mod:`.schemas`: the strict
converter, ``parse_body``, the server's own shapes), SSE framing (:mod:`.sse`),
OpenAPI (:mod:`.openapi`), the error table (:mod:`.errors`), metrics and the
``openai`` dialect (:mod:`.dialect`), which API-dialect plugins subclass. The
core's own OpenAI surfaces live in :mod:`musegl_core.openai`."""

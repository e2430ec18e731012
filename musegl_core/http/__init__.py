"""The HTTP front: the Litestar app (:mod:`.app`), the Chat Completions wire
format (:mod:`.schemas`), request planning and response assembly
(:mod:`.completions`), SSE framing (:mod:`.sse`) and the ``openai`` dialect
(:mod:`.dialect`), which API-dialect plugins subclass."""

"""The generation service: what every HTTP API surface generates through.

* :mod:`~musegl_core.service.conversation`: what to generate (messages,
  tools, tool choice, answer format, the worker request's settings);
* :mod:`~musegl_core.service.prepare`: tool preflight, template rendering,
  output constraints, images → a :class:`~musegl_core.service.prepare.Plan`;
* :mod:`~musegl_core.service.generation`: submit, wait for admission or
  prefill, typed events (:mod:`~musegl_core.service.events`);
* :mod:`~musegl_core.service.output`: one choice's text, tool calls, usage;
* :mod:`~musegl_core.service.sessions`: sessions named by a client's own
  conversation key (soft sessions);
* :mod:`~musegl_core.service.reasoning_seal`: the signed round trip of
  generated reasoning ids;
* :mod:`~musegl_core.service.service`: :class:`GenerationService`, the
  above bound to the running server.
"""

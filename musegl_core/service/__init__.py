"""The generation service: the floor every HTTP API surface generates through.

* :mod:`~musegl_core.service.conversation`: what to generate (messages,
  tools, tool choice, answer format) and how (:class:`~musegl_core.service.conversation.Settings`);
* :mod:`~musegl_core.service.rules`: the request rules every API shares
  (completion limit, sampling and ``logit_bias``, stop strings, ``n``,
  session ids, ``cache_salt``, ``prompt_cache_key``), and
  :mod:`~musegl_core.service.stopping` (stop token ids, ``min_tokens``);
* :mod:`~musegl_core.service.prepare`: tool preflight, template rendering,
  output constraints (:mod:`~musegl_core.service.constraints`), images → a
  :class:`~musegl_core.service.prepare.Plan` (a raw prompt: ``prepare_text``);
* :mod:`~musegl_core.service.generation`: submit the ``n`` choices
  (:mod:`~musegl_core.service.choices`), wait for admission or prefill, typed
  events (:mod:`~musegl_core.service.events`);
* :mod:`~musegl_core.service.output`: one choice's text, tool calls, usage and
  logprobs (:mod:`~musegl_core.service.logprobs`);
* :mod:`~musegl_core.service.sessions`: sessions named by a client's own
  conversation key (soft sessions);
* :mod:`~musegl_core.service.reasoning_seal`: the signed round trip of
  generated reasoning ids;
* :mod:`~musegl_core.service.service`: :class:`GenerationService`, the
  above bound to the running server.

Nothing here imports :mod:`musegl_core.http` or a surface (``tests/test_layers.py``).
"""

"""musegl-anthropic: the Anthropic Messages API surface for musegl.

The plugin reaches the core only through the ``musegl_api_surfaces`` hook
(:mod:`musegl_anthropic.plugin`); :class:`~musegl_anthropic.surface.MessagesSurface`
is a thin adapter over the core's generation service:

* :mod:`musegl_anthropic.schemas`: the wire shapes (attrs classes);
* :mod:`musegl_anthropic.request`: a request body → a
  :class:`~musegl_core.service.conversation.Conversation`;
* :mod:`musegl_anthropic.blocks`: the service's typed events → content
  blocks and the Messages stream's events;
* :mod:`musegl_anthropic.errors`: Anthropic's error envelope.
"""

__version__ = "0.1.0"

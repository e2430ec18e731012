"""musegl-openrouter: the ``openrouter`` API dialect for musegl.

Enable it with ``musegl serve --api-dialect openrouter``. The dialect reaches
the core only through the ``musegl_dialects`` hook (:mod:`musegl_openrouter.plugin`);
:class:`~musegl_openrouter.dialect.OpenRouterDialect` overrides the places
where OpenRouter's wire format differs from OpenAI's.
"""

__version__ = "0.1.0"

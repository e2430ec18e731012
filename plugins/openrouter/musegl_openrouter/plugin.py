"""The plugin module named by the ``openrouter`` entry point (group ``musegl``).

Import is cheap and free of side effects: the dialect class is imported only
when the front creates it.
"""

from __future__ import annotations

from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import DialectSpec


def _create():
    from musegl_openrouter.dialect import OpenRouterDialect

    return OpenRouterDialect()


@hookimpl
def musegl_dialects():
    return [
        DialectSpec(
            "openrouter",
            "OpenRouter wire format: usage on the finish chunk, numeric error codes with "
            "metadata, parseable context-overflow counts, reasoning also as `reasoning`",
            _create,
        )
    ]

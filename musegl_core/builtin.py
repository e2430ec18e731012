"""The core's own plugin: the defaults every installation has.

It registers through the same hooks as any third-party plugin: the ``muse``
chat template and the ``openai`` API dialect.
"""

from __future__ import annotations

from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import DialectSpec, TemplateSpec


@hookimpl
def musegl_templates():
    from musegl_core.chat.template import MuseTemplate

    return [TemplateSpec("muse", "Muse Glimmer ATEM chat template", MuseTemplate)]


@hookimpl
def musegl_dialects():
    from musegl_core.http.dialect import Dialect

    return [DialectSpec("openai", "OpenAI Chat Completions wire format", Dialect)]

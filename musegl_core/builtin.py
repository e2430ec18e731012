"""The core's own plugin: the defaults every installation has.

It registers through the same hooks as any third-party plugin: the ``muse``
chat template, the ``openai`` API dialect, and the ``chat`` (Chat
Completions), ``completions`` and ``tokenize`` API surfaces.
"""

from __future__ import annotations

from musegl_core.plugins.hookspecs import hookimpl
from musegl_core.plugins.specs import DialectSpec, SurfaceSpec, TemplateSpec


@hookimpl
def musegl_templates():
    from musegl_core.chat.template import MuseTemplate

    return [TemplateSpec("muse", "Muse Glimmer ATEM chat template", MuseTemplate)]


@hookimpl
def musegl_dialects():
    from musegl_core.http.dialect import Dialect

    return [DialectSpec("openai", "OpenAI Chat Completions wire format", Dialect)]


@hookimpl
def musegl_api_surfaces():
    from musegl_core.openai.surface import ChatCompletionsSurface, CompletionsSurface, TokenizeSurface

    return [
        SurfaceSpec("chat", "OpenAI Chat Completions (POST /v1/chat/completions), spelled by --api-dialect",
                    ChatCompletionsSurface),
        SurfaceSpec("completions", "OpenAI Completions (POST /v1/completions): a raw prompt, no template",
                    CompletionsSurface),
        SurfaceSpec("tokenize", "POST /tokenize and /detokenize with the served tokenizer", TokenizeSurface),
    ]

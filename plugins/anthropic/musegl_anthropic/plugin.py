"""Hook implementations of musegl-anthropic (import is cheap: the surface loads on use)."""

from __future__ import annotations

from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import SurfaceSpec


def _create(context):
    from musegl_anthropic.surface import MessagesSurface

    return MessagesSurface(context)


@hookimpl
def musegl_api_surfaces():
    return [SurfaceSpec("anthropic", "Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens)",
                        _create)]

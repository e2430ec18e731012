"""The plugin module named by the ``responses`` entry point (group ``musegl``).

Registers the ``responses`` API surface and its ``musegl serve`` flags (the
response store's bounds, the keep-alive interval). Importing it is cheap:
the surface loads when the app is built.
"""

from __future__ import annotations

import argparse

from musegl_core.plugins import hookimpl
from musegl_core.plugins.specs import SurfaceSpec


def _create(context):
    from musegl_responses.surface import ResponsesSurface

    return ResponsesSurface(context)


@hookimpl
def musegl_api_surfaces():
    return [SurfaceSpec("responses", "OpenAI Responses API (POST /v1/responses, response store)", _create)]


@hookimpl
def musegl_serve_options(group: argparse._ArgumentGroup) -> None:
    from musegl_responses.settings import add_options

    add_options(group)

"""Hook specifications: the only way plugins talk to the musegl core.

A plugin is a module (or object) with functions named like the hooks below,
decorated with :data:`hookimpl`, and published under the entry-point group
``musegl``::

    # pyproject.toml of your plugin
    [project.entry-points.musegl]
    myplugin = "myplugin.plugin"

    # myplugin/plugin.py
    from musegl_core.plugins import hookimpl
    from musegl_core.plugins.specs import ExecutorSpec

    @hookimpl
    def musegl_executors():
        return [ExecutorSpec(name="mybackend", description="...", priority=10,
                             available=lambda: True, create=create_executor)]

Every "list" hook returns a list of *spec* objects (attrs classes from
:mod:`musegl_core.plugins.specs`); the core collects the lists of all loaded
plugins. Names must be unique across plugins; a duplicate is a start-up error
naming both plugins. A function decorated with :data:`hookimpl` whose name is
no hook below (a misspelling) is a start-up error too.

**Which process calls which hook** is :data:`CALLED_IN` (and each docstring):
the front (the HTTP server, with ``musegl serve``'s start-up checks) builds
dialects, templates, tool parsers and API surfaces, and reads executor and
speculator specs only to check the configuration from files (``available``,
``check``, ``kv_layout``); the worker creates the executor and the
speculator and calls nothing else, so it never imports a surface or a
dialect. A manager made for one process (``PluginManager(process=...)``)
refuses the other hooks. Keep the plugin module's import cheap: import
torch, mlx and the like inside factories (``create``), not at module top
level, and a surface's or dialect's modules inside its hook, so that each
process imports only what it runs.
"""

from __future__ import annotations

import argparse

import pluggy

PROJECT = "musegl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

FRONT = "front"
WORKER = "worker"
#: The processes that call each hook. The command line's other commands
#: (``musegl render``, ``parse``, ``generate``, ``plugins``) may call any.
CALLED_IN = {
    "musegl_executors": (FRONT, WORKER),  # the front: specs only (checks from files); the worker: create
    "musegl_speculators": (FRONT, WORKER),
    "musegl_tool_parsers": (FRONT,),
    "musegl_dialects": (FRONT,),
    "musegl_api_surfaces": (FRONT,),
    "musegl_templates": (FRONT,),
    "musegl_serve_options": (FRONT,),
    "musegl_commands": (),  # the ``musegl`` command line only
}


@hookspec
def musegl_executors() -> list:
    """Return the model backends this plugin provides, as ``ExecutorSpec`` objects.

    Called in the worker (to create the executor), in the front for its
    start-up checks (``available``, ``check``, ``kv_layout``: never
    ``create``) and by ``musegl plugins``.
    ``ExecutorSpec.available()`` must be cheap and must not allocate device
    memory; it answers "can this backend run on this machine?" (the CUDA
    plugin checks ``torch.cuda.is_available()``). When the user does not name
    an executor, the available one with the highest ``priority`` is chosen.
    ``ExecutorSpec.create(options)`` receives :class:`~musegl_core.plugins.specs.ExecutorOptions`
    (model path, dtype, progress callback, the plugin's own CLI values) and
    returns an object implementing :class:`musegl_core.engine.executor.Executor`.
    """


@hookspec
def musegl_speculators() -> list:
    """Return speculative-decoding strategies as ``SpeculatorSpec`` objects.

    Called in the worker once the executor is loaded (and in the front, whose
    start-up checks call ``SpeculatorSpec.check`` only):
    ``SpeculatorSpec.create(executor, options)`` returns a
    :class:`musegl_core.engine.speculator.Speculator` when the user enabled it
    through a flag the plugin adds itself (``--dflash DRAFT``), else None.
    The engine asks it for draft tokens before each step, verifies them in
    the same target step (the target samples after every draft row with the
    request's own sampling) and keeps the agreeing prefix, so the output is
    identical with or without the speculator. It sees the tapped hidden
    states of every step (``Speculator.taps``) and keeps any per-position
    state in the engine's block ids. See docs/executor.md.
    """


@hookspec
def musegl_tool_parsers() -> list:
    """Return tool-call parsers as ``ToolParserSpec`` objects.

    Selected with ``musegl serve --tool-parser NAME``. Called in the front
    (and by ``musegl render``/``parse``), never in the worker.
    ``ToolParserSpec.create(tools, options)`` receives the request's declared
    tools and returns a parser fed with the text of tool-addressed messages;
    see :class:`musegl_core.plugins.specs.ToolParserSpec` for the protocol.
    """


@hookspec
def musegl_dialects() -> list:
    """Return API dialects as ``DialectSpec`` objects.

    Selected with ``musegl serve --api-dialect NAME``; the core provides
    ``openai``. A dialect is a subclass of
    :class:`musegl_core.http.dialect.Dialect` overriding the places where its
    wire format differs (error bodies, usage placement, model entries,
    reasoning field names). It spells the core's Chat Completions and
    Completions surfaces and the server's own routes (models, health, ...);
    a whole different API is an API surface (``musegl_api_surfaces``).
    Called in the front only.
    """


@hookspec
def musegl_api_surfaces() -> list:
    """Return whole HTTP APIs as ``SurfaceSpec`` objects, served side by side.

    Every loaded plugin's surfaces are mounted at once (the core provides
    ``chat``, OpenAI Chat Completions, ``completions`` and ``tokenize``; ``musegl-anthropic``
    adds Anthropic Messages, ``musegl-responses`` the OpenAI Responses API).
    Called in the front only, when the app is built:
    ``SurfaceSpec.create(context)`` receives the
    :class:`musegl_core.http.surface.SurfaceContext` and returns an
    :class:`musegl_core.http.surface.ApiSurface` subclass instance. A surface

    * returns its Litestar route handlers from ``routes()``, each declaring
      its OpenAPI entry with ``operation_class=musegl_core.http.openapi.operation(
      body=..., responses=...)`` built from the attrs classes it parses and
      writes (they are its schemas in ``/openapi.json``);
    * turns :class:`~musegl_core.errors.ApiError` into its own envelope
      (``error_body``, ``error_status``, ``error_headers``): the app uses it
      for every error raised in its routes and for 404/405 under its
      ``prefixes``;
    * reads the API key its clients send (``credential``; default
      ``Authorization: Bearer``), checked against ``--api-key``;
    * generates through ``context.service`` (a
      :class:`~musegl_core.service.service.GenerationService`): it parses its
      wire format into a :class:`~musegl_core.service.conversation.Conversation`,
      ``service.prepare(conversation, request_id=...)``, then
      ``service.generation(plan)`` and its typed events
      (:mod:`musegl_core.service.events`).

    Two surfaces serving the same method and path are a start-up error naming
    both. The core's own Chat Completions surface
    (``musegl_core/openai/surface.py``) is the example to copy;
    ``plugins/anthropic`` is a complete plugin.
    """


@hookspec
def musegl_templates() -> list:
    """Return chat templates as ``TemplateSpec`` objects.

    The core provides ``muse``. A template turns a validated chat request into
    ordered prompt segments (text with special tokens written out, images).
    Called in the front and by ``musegl render``, never in the worker.
    """


@hookspec
def musegl_serve_options(group: argparse._ArgumentGroup) -> None:
    """Add the plugin's own ``musegl serve`` flags to ``group``.

    ``group`` is an argparse argument group titled with the plugin's name.
    Use long, plugin-prefixed flags (``--dflash-n-draft``). Parsed values are
    handed back to the plugin's factories through ``options.extra`` (a dict
    keyed by argparse ``dest``). Called by ``musegl serve`` (the front) and
    ``musegl generate`` when they build their parser. Validate in the factory and raise
    :class:`musegl_core.errors.ConfigError` with a one-line reason; the CLI turns
    it into exit status 2.
    """


@hookspec
def musegl_commands() -> list:
    """Return extra ``musegl`` subcommands as ``CommandSpec`` objects.

    ``musegl NAME ...`` runs a plugin's command when NAME is not one of the
    core's own (``serve``, ``generate``, ...; a plugin command cannot replace
    them: that is a start-up error naming the plugin). Called by the ``musegl``
    command line only, never by the server's processes. ``musegl --help`` lists
    the plugin commands after the core's. Every installed plugin is loaded to
    find them. For ``musegl NAME ARGS``, the core builds an argparse parser
    (``prog`` is ``musegl NAME``, usage errors exit 2 with one line), calls
    ``CommandSpec.add_arguments(parser)``, parses ARGS and calls
    ``CommandSpec.run(args)``; its return value (None means 0) is the exit
    status. Raise :class:`musegl_core.errors.ConfigError` with one line for
    unusable input: the CLI prints ``musegl NAME: error: LINE`` and exits
    with status 2. Keep ``add_arguments`` cheap (import heavy libraries in
    ``run``), since ``--help`` calls it. ``musegl-executorch``'s ``export``
    is an example (``plugins/executorch/musegl_executorch/plugin.py``).
    """

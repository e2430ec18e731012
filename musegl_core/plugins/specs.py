"""The objects plugins return from the hooks in :mod:`musegl_core.plugins.hookspecs`."""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class ExecutorOptions:
    """What an executor factory receives.

    ``model`` is a GGUF file or a Hugging Face directory (config.json +
    safetensors). ``device`` is ``None`` (backend picks) or a string such as
    ``"cpu"``/``"cuda:0"``. ``dtype`` is ``None`` (backend default) or
    ``float32``/``float16``/``bfloat16``. ``progress(done, total, what)`` reports
    loading progress; call it as often as you like. ``extra`` holds the values
    of the flags the plugin added through ``musegl_serve_options``.
    ``mmproj`` is the vision projector GGUF given with ``--mmproj`` (None: a
    GGUF model loads text-only; a Hugging Face directory carries its vision
    weights itself). ``max_context`` is the server's ``--max-context`` (None
    where no fixed budget applies, as in ``musegl generate``); an executor
    whose model cannot reach it raises ``ConfigError``. ``kv_cache_dtype`` is
    ``--kv-cache-dtype`` (``auto`` or ``fp8``; only executors whose spec lists
    it in ``kv_cache_dtypes`` get anything but ``auto``).
    """

    model: str
    device: str | None = None
    dtype: str | None = None
    demo: bool = False
    mmproj: str | None = None
    max_context: int | None = None
    kv_cache_dtype: str = "auto"
    progress: Callable[[int, int, str], None] | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ExecutorSpec:
    """A named model backend.

    ``create(options)`` loads the model and returns the executor.
    ``available()`` answers cheaply whether it can run here. ``kv_layout``
    (optional) answers, from the checkpoint's config alone and *before* any
    weight is loaded, ``(bytes_per_block, block_size)`` of the KV cache the
    executor would allocate for ``options``; ``musegl serve`` uses it to
    refuse a ``--kv-cache-memory`` that cannot hold the limits before loading.
    ``unavailable_reason`` (optional) says in one line why ``available()`` is
    False (a missing library and how to install it); ``--executor NAME``
    then stops with that line instead of a generic one.

    ``claims(model)`` (optional, cheap: look at the path, read no weights)
    answers whether ``model`` is in a format only this executor runs (an
    exported program); when the user names no executor, an available
    executor that claims the model is chosen before any other.
    ``check(options)`` (optional) checks, in the front before the worker
    starts and before any weight is read, that ``options.model`` (with the
    plugin's flags in ``options.extra``) is something this executor can serve,
    raising :class:`musegl_core.errors.ConfigError` with one line if not;
    ``musegl serve`` turns it into exit status 2. Without it the core's check
    applies (a GGUF file or Hugging Face directory with weights and a
    tokenizer: :func:`musegl_core.servable.check_servable`), which
    is also what a plugin calls for the paths it does not treat specially.

    ``kv_cache_dtypes``: the ``--kv-cache-dtype`` values the executor stores
    (``auto`` always); ``musegl serve`` refuses any other in one line at start-up.
    ``sliding_pages``: whether the executor's instances offer ``use_sliding_pages``
    (``--sliding-window-kv``); ``musegl serve`` refuses the flag in one line before
    the worker starts where it is False.
    """

    name: str
    description: str
    create: Callable[[ExecutorOptions], Any]
    available: Callable[[], bool] = lambda: True
    priority: int = 0
    kv_layout: Callable[[ExecutorOptions], tuple[int, int]] | None = None
    unavailable_reason: Callable[[], str | None] | None = None
    claims: Callable[[str], bool] | None = None
    check: Callable[[ExecutorOptions], None] | None = None
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    sliding_pages: bool = False
    #: (optional) before loading, what the weights will take on the device and the memory it
    #: has (:class:`musegl_core.engine.fit.MemoryPlan`), from the checkpoint's tensor table
    #: alone; ``musegl serve`` prints the fit and refuses a model that does not fit
    memory_plan: Callable[[ExecutorOptions], Any] | None = None


@attrs.frozen
class SpeculatorSpec:
    """A named drafting strategy (speculative decoding).

    ``create(executor, options)`` runs in the worker after the executor is
    loaded, with the same :class:`ExecutorOptions` (``options.extra`` holds
    the plugin's own flags). It returns an object implementing
    :class:`musegl_core.engine.speculator.Speculator`, or None when the
    user did not enable it (its flag is unset). Raise
    :class:`musegl_core.errors.ConfigError` with one line when the flags ask
    for something impossible (a draft that does not fit the target).

    ``check(options)`` (optional) validates the plugin's flags in the front,
    before the worker starts and before any weight is loaded (read configs
    only); ``musegl serve`` turns its ConfigError into exit status 2. It is
    called whether or not the plugin's flag is set.
    """

    name: str
    description: str
    create: Callable[..., Any]
    check: Callable[[ExecutorOptions], None] | None = None


@attrs.frozen
class ToolParserSpec:
    """A named tool-call parser (``musegl serve --tool-parser NAME``).

    Both callables run in the front, per request, only while tools are
    active (declared tools and ``tool_choice`` other than ``"none"``):

    * ``prepare(tools)`` (optional) runs in preflight, before anything is
      sent to the worker, with the active tools (``ToolDef`` objects). It
      checks and compiles their schemas, raising
      :class:`musegl_core.errors.ApiError` (400) to refuse the request, and
      returns an opaque object that ``create`` receives back.
    * ``create(tools, options)`` returns the parser of one response.
      ``options["aliases"]`` maps prompt names to declared names;
      ``options["prepared"]`` is what ``prepare`` returned (``None`` without
      ``prepare``).

    The parser has two methods:

    * ``feed(event, at_end=False)`` receives, in output order, the channel
      parser's :class:`~musegl_core.chat.channels.ToolDelta` (raw tool text)
      and :class:`~musegl_core.chat.channels.ToolMessageEnd` (a tool message
      or intent block ended) events. ``at_end`` is true for the events
      ``ChannelParser.finish`` settled, so an intent block that ended
      incomplete *before* the end of output (it broke off) can be told from
      one that the end of output cut.
    * ``finish(end)`` (``end``: ``eos``, ``length``, ``stop`` or ``cancel``)
      returns the validated calls — objects with ``id``, ``name`` (the
      declared name) and ``arguments`` (a dict or a JSON string) — or an
      empty list when a cut-off call set is suppressed; it raises
      ``ApiError`` (502 ``invalid_tool_output``) for an invalid call set.

    * ``grammar(tools, options)`` (optional) makes constrained tool calling
      possible (``tool_choice`` ``"required"`` or a named function,
      ``docs/constrained.md``): it returns llguidance Lark rules that define
      ``call_message``, one complete tool message of the raw output (header
      `` to=NAME<|message|>`` and the call markup, no terminator) calling one
      of ``options["names"]`` (declared names) with arguments that pass the
      parser's validation. ``options`` also carries ``aliases`` and
      ``prepared``. It raises ``ApiError`` (400) for a schema it cannot
      express. Without it, those ``tool_choice`` values are refused.
      With ``options["lazy"]`` true (``tool_choice`` ``"auto"`` with
      ``strict: true`` tools) it returns ``{"trigger": TEXT, "rules": LARK}``
      instead: ``trigger`` is the text that opens a call inside a message
      body (ATEM: ``<atem:function_calls>``), and ``rules`` define
      ``lazy_call``, everything after the trigger: one call of a tool of
      ``options["names"]`` (the strict ones) whose arguments pass validation,
      followed by ``lazy_end`` (defined by the core: what must follow the
      markup), or the opening text of a call of a tool of
      ``options["free_names"]``, where the rule ends (the rest of that call
      is free). ``docs/constrained.md`` 2.1.
    """

    name: str
    description: str
    create: Callable[..., Any]
    prepare: Callable[..., Any] | None = None
    grammar: Callable[..., Any] | None = None


@attrs.frozen
class DialectSpec:
    name: str
    description: str
    create: Callable[[], Any]


@attrs.frozen
class SurfaceSpec:
    """A whole HTTP API served next to the others (hook ``musegl_api_surfaces``).

    ``create(context)`` runs in the front when the app is built, with the
    :class:`musegl_core.http.surface.SurfaceContext` (settings, the
    generation service, the served model), and returns an
    :class:`musegl_core.http.surface.ApiSurface`: its routes (with their
    OpenAPI entries), its error envelope and how it reads credentials.
    """

    name: str
    description: str
    create: Callable[[Any], Any]


@attrs.frozen
class TemplateSpec:
    name: str
    description: str
    create: Callable[[], Any]


@attrs.frozen
class CommandSpec:
    """A ``musegl`` subcommand a plugin contributes (hook ``musegl_commands``).

    ``description`` is one line (``musegl --help`` shows it);
    ``add_arguments(parser)`` adds the command's arguments to an argparse
    parser; ``run(args)`` runs it with the parsed namespace and returns the
    exit status (None: 0).
    """

    name: str
    description: str
    add_arguments: Callable[[Any], None]
    run: Callable[[Any], int | None]

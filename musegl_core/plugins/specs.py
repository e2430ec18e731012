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
    """

    model: str
    device: str | None = None
    dtype: str | None = None
    demo: bool = False
    progress: Callable[[int, int, str], None] | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ExecutorSpec:
    name: str
    description: str
    create: Callable[[ExecutorOptions], Any]
    available: Callable[[], bool] = lambda: True
    priority: int = 0


@attrs.frozen
class SpeculatorSpec:
    name: str
    description: str
    create: Callable[..., Any]


@attrs.frozen
class ToolParserSpec:
    """A named tool-call parser.

    ``create(tools, options)`` is called once per request with the declared,
    active tools and returns a parser with two methods: ``feed(recipient,
    text)`` for the body text of a tool-addressed message as it streams, and
    ``finish(reason)`` returning the validated calls or raising
    :class:`musegl_core.errors.ApiError`. ``prepare(tools)`` (optional) runs
    before generation to validate schemas and may raise ``ApiError`` (400).
    """

    name: str
    description: str
    create: Callable[..., Any]
    prepare: Callable[..., Any] | None = None


@attrs.frozen
class DialectSpec:
    name: str
    description: str
    create: Callable[[], Any]


@attrs.frozen
class TemplateSpec:
    name: str
    description: str
    create: Callable[[], Any]

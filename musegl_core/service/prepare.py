"""Preparing a conversation: tool preflight, template rendering, output
constraints, images, and the worker request.

:func:`prepare` is everything between a surface's validated request and the
worker. Nothing is submitted before it returns, so every error it raises is a
400 (413 for an oversized image) that never reaches the worker.
"""

from __future__ import annotations

from typing import Any

import attrs

from musegl_core.chat.messages import ToolDef, image_parts
from musegl_core.config import ServeConfig
from musegl_core.engine.request import ImageInput
from musegl_core.errors import bad_request, unavailable, unsupported
from musegl_core.service import constraints
from musegl_core.service.choices import choice_requests
from musegl_core.service.conversation import Conversation, Settings, ToolChoice
from musegl_core.vision.preprocess import image_too_large
from musegl_core.worker import messages as m


@attrs.frozen
class Plan:
    """A conversation that passed every front-side check, ready for the worker."""

    generate: m.Generate
    stream: bool
    include_usage: bool
    hide_reasoning: bool
    ignore_eos: bool
    tools_active: bool = False
    tools: tuple[ToolDef, ...] = ()
    tool_aliases: dict[str, str] = attrs.field(factory=dict)
    #: What the tool parser's ``prepare`` returned in preflight (compiled
    #: schemas), handed to its ``create`` so that nothing is compiled twice.
    prepared_tools: Any = None
    image_count: int = 0  # image parts in the prompt
    logprobs: int = -1  # top alternatives per token (-1: no logprobs)
    tokenizer: Any = None  # the front's tokenizer (logprobs: the text of each id)
    n: int = 1  # choices
    parallel_tool_calls: bool = True  # False: at most one call is returned (the first)
    #: a raw prompt (:func:`prepare_text`): the output is the text as decoded,
    #: with no channels, reasoning or tool calls
    raw: bool = False

    def requests(self) -> list[m.Generate]:
        """One worker request per choice (:func:`~musegl_core.service.choices.choice_requests`)."""
        return choice_requests(self.generate, self.n)


@attrs.frozen
class ToolSetup:
    """The request's tools after preflight: whether they are ``active``, the
    declared ``tools``, and what the tool parser's ``prepare`` returned
    (compiled schemas; None while inactive)."""

    active: bool
    tools: tuple[ToolDef, ...] = ()
    prepared: Any = None


def tools_active(tools: tuple[ToolDef, ...] | list[ToolDef], choice: ToolChoice, tool_parser: Any) -> bool:
    """Whether the declared tools are active: declared, ``tool_choice`` not
    ``none``, and a tool parser configured (else a 400 naming ``tools``)."""
    if not tools:
        if choice.mode in ("required", "named"):
            raise bad_request("a 'tool_choice' that requires a call needs 'tools'", param="tool_choice")
        return False
    if choice.mode == "none":
        return False
    if tool_parser is None:
        raise unsupported("tools", "tool calling is not enabled on this server (start it with --tool-parser)")
    return True


def setup_tools(tools: tuple[ToolDef, ...] | list[ToolDef], choice: ToolChoice, tool_parser: Any) -> ToolSetup:
    """:func:`tools_active`, then the tool parser's preflight (schema checks,
    400 ``invalid_tool_schema``) on the active tools. A surface may call it
    before it parses the messages, to report a bad tool first; :func:`prepare`
    calls it otherwise."""
    active = tools_active(tools, choice, tool_parser)
    prepared = tool_parser.prepare(list(tools)) if active and tool_parser.prepare is not None else None
    return ToolSetup(active, tuple(tools), prepared)


def prompt_images(messages, max_image_bytes: int) -> tuple[ImageInput, ...]:
    """The images the worker decodes, in prompt order; a compressed image over
    ``--max-image-bytes`` is a 413 ``image_too_large`` here, before it travels."""
    images = []
    for part in image_parts(messages):
        if len(part.data) > max_image_bytes:
            raise image_too_large(len(part.data), max_image_bytes)
        images.append(ImageInput(part.media_type, part.url.split(",", 1)[1], part.detail))
    return tuple(images)


def prepare(
    conversation: Conversation,
    *,
    request_id: str,
    config: ServeConfig,
    template: Any,
    tool_parser: Any = None,
    tokenizer: Any = None,
    tool_setup: ToolSetup | None = None,
) -> Plan:
    """Render ``conversation`` and build its worker request; raises :class:`ApiError`.

    ``template`` is a template plugin's object (``render``); ``tool_parser``
    the configured :class:`~musegl_core.plugins.specs.ToolParserSpec` or
    ``None``; ``tokenizer`` the front's (needed for logprobs only);
    ``tool_setup`` what :func:`setup_tools` returned for the conversation's
    tools, when the surface ran it already.
    """
    settings = conversation.settings
    choice = conversation.tool_choice
    if tool_setup is None:
        tool_setup = setup_tools(conversation.tools, choice, tool_parser)
    tools = list(tool_setup.tools)
    active, prepared_tools = tool_setup.active, tool_setup.prepared
    rendered = template.render(conversation.messages, tools, tools_active=active, variables=conversation.variables,
                               **({"tool_block_once": True} if conversation.tool_block_once else {}))
    if settings.logprobs >= 0 and tokenizer is None:
        raise unavailable("logprobs need the served tokenizer, which the front could not load", code="model_loading")
    aliases = dict(rendered.tool_aliases)
    answer = (conversation.answer.schema, conversation.answer.param) if conversation.answer is not None else None
    grammar = constraints.output_grammar(
        answer, config=config, mode=choice.mode, named=choice.name, tools_active=active, tools=tools,
        tool_parser=tool_parser, prepared_tools=prepared_tools, aliases=aliases, parallel=choice.parallel,
    )
    lazy_grammar = None if grammar is not None else constraints.lazy_call_grammar(
        mode=choice.mode, tools_active=active, tools=tools, tool_parser=tool_parser, prepared_tools=prepared_tools,
        aliases=aliases, parallel=choice.parallel,
    )
    generate = settings.request(
        request_id,
        tuple(rendered.segments),
        grammar=grammar,
        lazy_grammar=lazy_grammar,
        images=prompt_images(conversation.messages, config.max_image_bytes),
    )
    return Plan(
        generate=generate,
        stream=settings.stream,
        include_usage=conversation.include_usage,
        hide_reasoning=conversation.hide_reasoning,
        ignore_eos=settings.ignore_eos,
        tools_active=active,
        tools=tuple(tools),
        tool_aliases=aliases,
        prepared_tools=prepared_tools,
        image_count=rendered.image_count,
        logprobs=settings.logprobs,
        tokenizer=tokenizer if settings.logprobs >= 0 else None,
        n=conversation.n,
        parallel_tool_calls=choice.parallel,
    )


def prepare_text(
    prompt: m.PromptSegment, settings: Settings, *, request_id: str, include_usage: bool = False, n: int = 1
) -> Plan:
    """A raw prompt's plan (``/v1/completions``): ``prompt`` is what the model
    reads, without the chat template (``settings.add_bos`` says whether BOS
    goes first); the output is the decoded text as it is. ``settings.logprobs``
    must be -1 (a raw plan reports none)."""
    if settings.logprobs >= 0:
        raise ValueError("a raw prompt's plan reports no logprobs")
    return Plan(
        generate=settings.request(request_id, (prompt,)),
        stream=settings.stream,
        include_usage=include_usage,
        hide_reasoning=False,
        ignore_eos=settings.ignore_eos,
        n=n,
        raw=True,
    )

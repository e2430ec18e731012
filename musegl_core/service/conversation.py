"""A conversation as every API surface hands it to the generation service.

A surface parses its own wire format (Chat Completions messages, Anthropic
content blocks, Responses items) into the core's chat vocabulary
(:class:`~musegl_core.chat.messages.Message`, :class:`~musegl_core.chat.messages.ToolDef`)
and the settings below; :func:`musegl_core.service.prepare.prepare` renders it
with the chat template and builds the worker request. Everything here is
already validated: ranges and contradictions are the surface's 400s, in its
own parameter names.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from musegl_core.chat.messages import Message, ToolDef
from musegl_core.chat.template import TemplateVariables
from musegl_core.engine.executor import SamplingParams
from musegl_core.engine.request import GenerateRequest, PromptSegment

TOOL_CHOICE_MODES = ("auto", "none", "required", "named")


@attrs.frozen
class ToolChoice:
    """``mode``: ``auto`` (the model decides), ``none`` (tools inactive: no
    tool block in the prompt, no calls), ``required`` (at least one call,
    enforced by the grammar) or ``named`` (a call of ``name``)."""

    mode: str = "auto"
    name: str | None = None
    #: ``parallel_tool_calls``: False allows at most one call in the turn (a
    #: call grammar allows exactly one and then ends the turn; unconstrained
    #: output keeps its first call only)
    parallel: bool = True

    def __attrs_post_init__(self) -> None:
        if self.mode not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool choice mode {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice needs a name, and only it")


@attrs.frozen
class AnswerFormat:
    """The final answer must be JSON satisfying ``schema`` (``True``: any JSON
    object), enforced by constrained decoding; ``param`` is the request
    parameter that asked for it (named in errors)."""

    schema: Any
    param: str


@attrs.frozen
class Settings:
    """How to generate, whatever the prompt: every field is the worker
    request's field of the same name (:class:`~musegl_core.engine.request.RequestOptions`).

    ``max_tokens`` (None: the context budget), ``sampling``, request ``stop``
    strings and ``stop_token_ids``, ``min_tokens``, ``ignore_eos``, the
    session (``session_id``, ``soft_session``), ``cache_salt``, ``stream``,
    ``logprobs`` (top alternatives per token, -1 for none), which
    ``special_tokens`` the text shows, ``clamp_to_context`` (a full context
    ends the answer instead of refusing the request) and ``add_bos`` (False
    for a raw prompt read exactly as given).
    """

    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    session_id: str | None = None
    soft_session: bool = False
    cache_salt: str | None = None
    stream: bool = False
    logprobs: int = -1
    special_tokens: str = "all"
    clamp_to_context: bool = False
    add_bos: bool = True
    retention: str | None = None  # the residency granted (service/retention.py)

    def request(self, request_id: str, prompt: tuple[PromptSegment, ...], **more: Any) -> GenerateRequest:
        """The worker request for ``prompt`` with these settings (``more``: its
        grammars and images)."""
        return GenerateRequest(id=request_id, prompt=prompt, **attrs.asdict(self, recurse=False), **more)


@attrs.frozen
class Conversation:
    """What to generate.

    ``settings`` (:class:`Settings`) say how to generate; :func:`prepare`
    builds the worker request from them with the rendered prompt, its images
    and the output grammars.

    ``hide_reasoning`` removes reasoning from the output events (the model
    still reasons, and its tokens are counted). ``n`` choices share the
    prompt's KV (1..``--max-n``, never with a session).
    """

    messages: Sequence[Message]
    settings: Settings
    tools: tuple[ToolDef, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    variables: TemplateVariables = TemplateVariables()
    answer: AnswerFormat | None = None
    hide_reasoning: bool = False
    include_usage: bool = False  # the surface reports usage in its stream (Chat Completions' stream_options)
    tool_block_once: bool = False  # the template shows the tool block in the first system block only
    n: int = 1

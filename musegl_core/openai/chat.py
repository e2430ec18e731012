"""Chat Completions: the core's own API surface over the generation service.

:func:`read_chat` applies every Chat Completions rule that does not need the
model (ranges, contradictions, the reject list, tools without a parser) in
this API's parameter names and turns the request into a
:class:`~musegl_core.service.conversation.Conversation`, which the service
prepares (:meth:`~musegl_core.service.service.GenerationService.prepare`:
template, output constraints, images; :func:`plan_chat` does both). Nothing
is submitted before that returns, so every bad request is a 400 that never
reaches the worker.

:func:`complete` builds the non-streaming object and :class:`ChatStream` the
SSE events (nothing is sent until the worker reports ``Started``), both from
a :class:`~musegl_core.service.generation.Generation`: the request's ``n``
choices (one worker request per choice, sharing the prompt's KV blocks) and
their typed events. :class:`ResponseAssembler` is the service's
:class:`~musegl_core.service.output.OutputAssembler` with the Chat Completions
shapes of its message, logprobs and usage.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Sequence

import attrs

from musegl_core import __version__
from musegl_core.chat.messages import ToolDef, parse_messages, parse_tools
from musegl_core.chat.template import TemplateVariables
from musegl_core.config import ServeConfig
from musegl_core.errors import bad_request, unsupported
from musegl_core.service import stopping
from musegl_core.service.logprobs import MAX_TOP_LOGPROBS
from musegl_core.http.schemas import to_json
from musegl_core.openai import schemas as s
from musegl_core.http.request_log import stream_failed
from musegl_core.http import sse
from musegl_core.http.dialect import Dialect
from musegl_core.service import events as ev
from musegl_core.service.conversation import AnswerFormat, Conversation, Settings, ToolChoice
from musegl_core.service.generation import Generation
from musegl_core.service.output import LogprobEntries, Output, OutputAssembler, reasoning_tokens
from musegl_core.service.prepare import Plan, ToolSetup, prepare, prompt_images, setup_tools
from musegl_core.service.retention import granted, openai_retention
from musegl_core.service.rules import (
    cache_salt,
    choice_count,
    completion_limit,
    prompt_cache_key,
    sampling_params,
    session_id,
    stop_strings,
)
from musegl_core.service.sessions import PROMPT_CACHE_KEY_SOURCE as CLIENT_KEY_SOURCE, client_session

__all__ = ["ChatPlan", "ChatStream", "Output", "ResponseAssembler", "ResponseMeta", "complete", "plan_chat", "read_chat",
           "prompt_images", "reasoning_tokens"]

REASONING_STRENGTHS = ("low", "medium", "high")


# -- planning ---------------------------------------------------------------------------
#: A request that passed every front-side check, ready for the worker (the service's plan).
ChatPlan = Plan


def plan_chat(
    request: s.ChatCompletionRequest,
    *,
    request_id: str,
    config: ServeConfig,
    template: Any,
    tool_parser: Any = None,
    header_session_id: str | None = None,
    client_keys: Sequence[tuple[str, str | None]] = (),
    tokenizer: Any = None,
) -> ChatPlan:
    """Validate ``request`` and render its prompt; raises :class:`ApiError` (400).

    ``template`` is a template plugin's object (``render``); the other
    arguments are :func:`read_chat`'s. What the surface does with the
    service's :meth:`~musegl_core.service.service.GenerationService.prepare`,
    for ``musegl render`` and ``/tokenize``.
    """
    conversation, tool_setup = read_chat(request, config=config, tool_parser=tool_parser,
                                         header_session_id=header_session_id, client_keys=client_keys)
    return prepare(conversation, request_id=request_id, config=config, template=template, tool_parser=tool_parser,
                   tokenizer=tokenizer, tool_setup=tool_setup)


def read_chat(
    request: s.ChatCompletionRequest,
    *,
    config: ServeConfig,
    tool_parser: Any = None,
    header_session_id: str | None = None,
    client_keys: Sequence[tuple[str, str | None]] = (),
) -> tuple[Conversation, ToolSetup]:
    """Validate ``request`` into the service's :class:`~musegl_core.service.conversation.Conversation`
    and its tools after preflight; raises :class:`ApiError` (400).

    ``tool_parser`` is the configured :class:`~musegl_core.plugins.specs.ToolParserSpec` or
    ``None`` (tools without ``--tool-parser`` are refused). ``client_keys``
    are the agent clients' conversation keys from the headers, ``(source,
    value)`` (:func:`~musegl_core.service.sessions.client_session`): without a
    named session, the first one present (after the body's
    ``prompt_cache_key``) names a soft session.
    """
    _check_fixed_choices(request)
    max_tokens = completion_limit(request)
    sampling = sampling_params(request)
    stops = stop_strings(request.stop)
    session = session_id(request.session_id, header_session_id)
    salt = cache_salt(request.cache_salt)
    n = choice_count(request.n, config, session)
    key = prompt_cache_key(request.prompt_cache_key)
    retention = granted(openai_retention(request.prompt_cache_retention), config.kv_offload_dir is not None)
    soft = False
    if session is None and n == 1:  # n choices cannot share one transcript: those run anonymously
        session, soft = client_session(None, [(CLIENT_KEY_SOURCE, key), *client_keys])
    strength, hide_reasoning = reasoning_controls(request)
    variables = template_variables(request.chat_template_kwargs, strength)
    choice, tools = active_tools(request, tool_parser)
    tool_setup = setup_tools(tools, choice, tool_parser)  # a bad tool schema is reported before bad messages
    messages = parse_messages(request.messages)
    answer = answer_schema(request)
    stream = bool(request.stream)
    constrained = answer is not None or choice.mode in ("required", "named")
    settings = Settings(
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        stop_token_ids=stopping.stop_token_ids(request.stop_token_ids),
        min_tokens=stopping.min_tokens(request.min_tokens, max_tokens, constrained=constrained),
        ignore_eos=bool(request.ignore_eos),
        session_id=session,
        soft_session=soft,
        cache_salt=salt,
        stream=stream,
        logprobs=(request.top_logprobs or 0) if request.logprobs else -1,
        special_tokens="control" if request.skip_special_tokens else "all",
        retention=retention,
    )
    conversation = Conversation(
        messages=messages,
        settings=settings,
        tools=tuple(tools),
        tool_choice=choice,
        variables=variables,
        answer=None if answer is None else AnswerFormat(*answer),
        hide_reasoning=hide_reasoning,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        n=n,
    )
    return conversation, tool_setup


def _check_fixed_choices(request: s.ChatCompletionRequest) -> None:
    """Parameters musegl accepts only at one value, and ``top_logprobs``."""
    if request.top_logprobs is not None:
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {request.top_logprobs}",
                              param="top_logprobs")
        if not request.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if request.add_generation_prompt is not None and request.add_generation_prompt is not True:
        raise unsupported("add_generation_prompt", "add_generation_prompt must be true (or absent)")
    if request.continue_final_message is not None and request.continue_final_message is not False:
        raise unsupported("continue_final_message", "continue_final_message must be false (or absent)")


def reasoning_controls(request: s.ChatCompletionRequest) -> tuple[str | None, bool]:
    """The template's ``reasoning_strength`` and whether to hide reasoning
    (see docs/protocol.md). Disabling reasoning, unknown efforts and
    contradictions are 400s."""
    options = request.reasoning or s.ReasoningOptions()
    if options.enabled is False:
        raise unsupported("reasoning.enabled", "reasoning cannot be disabled for this model")
    strength = None
    for param, value in (
        ("reasoning_effort", request.reasoning_effort),
        ("reasoning.effort", options.effort),
        (
            "chat_template_kwargs.reasoning_strength",
            request.chat_template_kwargs.reasoning_strength if request.chat_template_kwargs else None,
        ),
    ):
        if value is None:
            continue
        if value not in REASONING_STRENGTHS:
            raise unsupported(param, f"'{param}' must be one of low, medium, high; got {value!r}")
        if strength is not None and value != strength:
            raise bad_request(f"'{param}' ({value}) contradicts the reasoning effort {strength!r}", param=param)
        strength = value
    exclude, include = options.exclude, request.include_reasoning
    if exclude is not None and include is not None and exclude == include:
        raise bad_request(
            f"include_reasoning={str(include).lower()} contradicts reasoning.exclude={str(exclude).lower()}",
            param="include_reasoning",
        )
    return strength, exclude is True or include is False


def template_variables(kwargs: s.ChatTemplateKwargs | None, strength: str | None) -> TemplateVariables:
    """The template variables from ``chat_template_kwargs`` and the reasoning effort."""
    values = attrs.asdict(kwargs or s.ChatTemplateKwargs())
    values["reasoning_strength"] = strength
    return TemplateVariables(**{name: value for name, value in values.items() if value is not None})


def active_tools(request: s.ChatCompletionRequest, tool_parser: Any) -> tuple[ToolChoice, list[ToolDef]]:
    """The request's ``tool_choice`` and its declared tools (``tools`` while
    tool calling is off is refused before the tools are read)."""
    mode, named = tool_choice_mode(request.tool_choice)
    choice = ToolChoice(mode, named, parallel=request.parallel_tool_calls is not False)
    if request.tools and mode != "none" and tool_parser is None:
        raise unsupported("tools", "tool calling is not enabled on this server (start it with --tool-parser)")
    return choice, list(parse_tools(request.tools)) if request.tools else []


def tool_choice_mode(choice: Any) -> tuple[str, str | None]:
    """``("auto" | "none" | "required" | "named", function name or None)``."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or not name:
            raise bad_request("a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              param="tool_choice")
        return "named", name
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or a named function", param="tool_choice")


def answer_schema(request: s.ChatCompletionRequest) -> tuple[Any, str] | None:
    """The JSON schema the final answer must satisfy (``True``: any JSON object)
    and the parameter that asked for it; None for free text."""
    found = None
    fmt = request.response_format
    if fmt is not None:
        if fmt.schema is not None and fmt.type != "json_object":
            raise bad_request("'response_format.schema' belongs to llama.cpp's json_object form; a json_schema "
                              "format takes its schema in 'json_schema.schema'", param="response_format.schema")
        if fmt.type == "json_object" and fmt.schema is not None:
            found = (fmt.schema, "response_format.schema")  # llama.cpp's spelling: the schema is enforced
        elif fmt.type == "json_object":
            found = (True, "response_format")
        elif fmt.type == "json_schema":
            spec = fmt.json_schema
            if not isinstance(spec, dict):
                raise bad_request("response_format json_schema needs a 'json_schema' object",
                                  param="response_format.json_schema")
            unknown = set(spec) - {"name", "schema", "strict", "description"}
            if unknown:
                raise unsupported(f"response_format.json_schema.{sorted(unknown)[0]}",
                                  f"unknown key {sorted(unknown)[0]!r} in response_format.json_schema")
            if "name" in spec and not isinstance(spec["name"], str):
                raise bad_request("'response_format.json_schema.name' must be a string",
                                  param="response_format.json_schema.name")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad_request("'response_format.json_schema.strict' must be a boolean",
                                  param="response_format.json_schema.strict")
            schema = spec.get("schema", True)  # OpenAI: a missing schema means any JSON
            found = (schema, "response_format.json_schema.schema")
        elif fmt.type != "text":
            raise unsupported("response_format",
                              f"response_format type {fmt.type!r} is not supported; use text, json_object or json_schema")
    if request.json_schema is not None:
        if found is not None:
            raise bad_request("send either 'response_format' or 'json_schema', not both", param="json_schema")
        found = (request.json_schema, "json_schema")
    if found is not None and not isinstance(found[0], (dict, bool)):
        raise bad_request(f"'{found[1]}' must be a JSON Schema (an object or a boolean)", param=found[1])
    if found is not None and found[0] is False:
        raise bad_request(f"'{found[1]}' is the schema false: no answer can satisfy it", param=found[1])
    return found


# -- responses ---------------------------------------------------------------------------
@attrs.frozen
class ResponseMeta:
    """What every response object of one request shares."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, model: str, backend: str) -> "ResponseMeta":
        return cls(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=model,
            system_fingerprint=f"musegl-{__version__}-{backend}",
        )

    def chunk(self, choices: list[s.ChunkChoice]) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(self.id, self.created, self.model, self.system_fingerprint, choices)


def wire_usage(usage: ev.Usage) -> s.Usage:
    """The Chat Completions usage object; ``completion_tokens_details`` only
    where the reasoning tokens are known."""
    details = None if usage.reasoning_tokens is None else s.CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens)
    return s.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=details,
    )


def wire_logprobs(entries: LogprobEntries | None, hide_reasoning: bool) -> s.ChoiceLogprobs | None:
    """``logprobs`` of a choice or chunk (reasoning entries absent while reasoning is hidden)."""
    if entries is None:
        return None
    return s.ChoiceLogprobs(content=list(entries.content),
                            reasoning_content=None if hide_reasoning else list(entries.reasoning))


def wire_tool_calls(output: OutputAssembler) -> list[s.ToolCall]:
    return [s.ToolCall(id=call.id, function=s.FunctionCall(name=call.name, arguments=call.arguments))
            for call in output.calls]


def chat_message(output: OutputAssembler, dialect: Dialect) -> s.AssistantMessage:
    """The non-streaming message of one choice."""
    reasoning = output.reasoning_text
    content = output.content_text
    calls = wire_tool_calls(output)
    hidden = output.plan.hide_reasoning or not reasoning
    return s.AssistantMessage(
        content=content if content or not calls else None,
        tool_calls=calls or None,
        **dialect.reasoning_fields(None if hidden else reasoning),
    )


class ResponseAssembler(OutputAssembler):
    """The service's assembler with the Chat Completions shapes (``musegl parse``)."""

    @property
    def tool_calls(self) -> list[s.ToolCall]:
        return wire_tool_calls(self)

    def choice_logprobs(self, unsent: bool = False) -> s.ChoiceLogprobs | None:
        """The ``logprobs`` of the choice (``unsent``: only entries not streamed yet)."""
        return wire_logprobs(self.logprob_entries(unsent), self.plan.hide_reasoning)

    def message(self, dialect: Dialect) -> s.AssistantMessage:
        """The non-streaming message."""
        return chat_message(self, dialect)


def combined_usage(usages: Sequence[s.Usage]) -> s.Usage:
    """The usage of a response with several choices: the prompt (and its cached
    positions) counted once, as choice 0 reported them; ``completion_tokens``
    summed over the choices (as OpenAI does); ``reasoning_tokens`` summed, or
    omitted when any choice could not count them."""
    first = usages[0]
    if len(usages) == 1:
        return first
    completion = sum(u.completion_tokens for u in usages)
    details = None
    if all(u.completion_tokens_details is not None for u in usages):
        details = s.CompletionTokensDetails(
            reasoning_tokens=sum(u.completion_tokens_details.reasoning_tokens for u in usages))
    return s.Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.prompt_tokens + completion,
        prompt_tokens_details=first.prompt_tokens_details,
        completion_tokens_details=details,
    )


async def complete(generation: Generation, meta: ResponseMeta, dialect: Dialect) -> s.ChatCompletion:
    """Run the generation's choices to the end and build the non-streaming response.
    An error of any choice fails the response (the others are cancelled)."""
    plan = generation.plan
    outputs = await generation.run()
    choices = [
        s.Choice(message=chat_message(output, dialect), finish_reason=generation.finished[index].reason,
                 index=index, logprobs=wire_logprobs(output.logprob_entries(), plan.hide_reasoning))
        for index, output in enumerate(outputs)
    ]
    return s.ChatCompletion(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        system_fingerprint=meta.system_fingerprint,
        choices=choices,
        usage=combined_usage([wire_usage(usage) for usage in generation.usages]),
    )


class ChatStream:
    """One streaming response.

    :meth:`open` submits the request's choices and waits until each has
    started (bounded by ``--streaming-preflight-timeout``); until then every
    error is an ordinary HTTP error. :meth:`events` then yields the SSE
    bytes: a role chunk per choice, reasoning and content deltas (each chunk
    names its choice's ``index``; choices interleave as their tokens arrive),
    tool calls, a finish chunk per choice, usage once (per the dialect, with
    the last finish chunk) and ``[DONE]``; errors after that point are SSE
    error events. Closing the iterator (client disconnect) or an error in
    any choice cancels every worker request still running.
    """

    def __init__(self, generation: Generation, meta: ResponseMeta, dialect: Dialect):
        plan = self.plan = generation.plan
        self.meta = meta
        self.dialect = dialect
        self.generation = generation
        self._usages: list[s.Usage | None] = [None] * plan.n
        self._calls: list[list[s.ToolCallDelta]] = [[] for _ in range(plan.n)]

    async def open(self) -> None:
        """Submit and wait until generation is ready; raises :class:`ApiError`."""
        await self.generation.open()

    async def close(self) -> None:
        """Leave the worker requests (cancelling those not done)."""
        await self.generation.close()

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body, keepalives included."""
        async for item in sse.with_keepalive(self._body(), self.dialect.keepalive):
            yield item

    async def _body(self) -> AsyncIterator[bytes]:
        try:
            # with logprobs asked for, every chunk carries them, empty on the role chunk (as OpenAI's does)
            opening = s.ChoiceLogprobs(content=[]) if self.plan.generate.logprobs >= 0 else None
            for index in range(self.plan.n):
                yield self._chunk(s.ChunkChoice(delta=s.RoleDelta(), index=index, logprobs=opening))
            remaining = self.plan.n
            async for event in self.generation.events():
                if isinstance(event, ev.ReasoningDelta):
                    yield self._chunk(s.ChunkChoice(delta=s.Delta(**self.dialect.reasoning_fields(event.text)),
                                                    index=event.choice, logprobs=self._logprobs(event.logprobs)))
                elif isinstance(event, ev.ContentDelta):
                    yield self._chunk(s.ChunkChoice(delta=s.Delta(content=event.text), index=event.choice,
                                                    logprobs=self._logprobs(event.logprobs)))
                elif isinstance(event, ev.ToolCallStart):
                    self._calls[event.choice].append(
                        s.ToolCallDelta(index=event.index, id=event.id, function=s.FunctionCall(event.name, "")))
                elif isinstance(event, ev.ToolCallArgumentsDelta):
                    call = self._calls[event.choice][event.index]
                    function = s.FunctionCall(call.function.name, call.function.arguments + event.arguments)
                    self._calls[event.choice][event.index] = attrs.evolve(call, function=function)
                elif isinstance(event, ev.UsageReport):
                    self._usages[event.choice] = wire_usage(event.usage)
                elif isinstance(event, ev.Finish):
                    remaining -= 1
                    for item in self._finish(event, last=remaining == 0):
                        yield item
                elif isinstance(event, ev.Failure):
                    stream_failed(event.error)
                    for item in self.dialect.stream_error(event.error, self.meta.chunk([])):
                        yield item
        finally:
            await self.close()

    def _finish(self, finish: ev.Finish, last: bool) -> list[bytes]:
        """A choice's tool calls and finish chunk; after the last choice, the
        usage (per the dialect) and ``[DONE]``."""
        index = finish.choice
        items = []
        if self._calls[index]:
            items.append(self._chunk(s.ChunkChoice(delta=s.Delta(tool_calls=self._calls[index]), index=index)))
        rest = self._logprobs(finish.logprobs)
        if rest is not None and not (rest.content or rest.reasoning_content):
            rest = None
        chunk = self.meta.chunk([s.ChunkChoice(delta=s.Delta(), finish_reason=finish.reason, index=index,
                                               logprobs=rest)])
        if not last:
            items.append(sse.data_event(to_json(chunk)))
            return items
        usage = combined_usage(self._usages) if self.plan.include_usage else None
        items += [sse.data_event(to_json(c)) for c in self.dialect.stream_tail(chunk, usage)]
        items.append(sse.DONE)
        return items

    def _logprobs(self, entries: LogprobEntries | None) -> s.ChoiceLogprobs | None:
        return wire_logprobs(entries, self.plan.hide_reasoning)

    def _chunk(self, choice: s.ChunkChoice) -> bytes:
        return sse.data_event(to_json(self.meta.chunk([choice])))

"""Chat Completions: the core's own API surface over the generation service.

:func:`plan_chat` applies every Chat Completions rule that does not need the
model (ranges, contradictions, the reject list, tools without a parser) in
this API's parameter names, turns the request into a
:class:`~musegl_core.service.conversation.Conversation` and has the service
prepare it (:func:`musegl_core.service.prepare.prepare`: template, output
constraints, images). Nothing is submitted before it returns, so every bad
request is a 400 that never reaches the worker.

:func:`complete` builds the non-streaming object and :class:`ChatStream` the
SSE events (nothing is sent until the worker reports ``Started``), both from
a :class:`~musegl_core.service.generation.Generation`: the request's ``n``
choices (one worker request per choice, sharing the prompt's KV blocks) and
their typed events. :class:`ResponseAssembler` is the service's
:class:`~musegl_core.service.output.OutputAssembler` with the Chat Completions
shapes of its message, logprobs and usage.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import attrs

from musegl_core import __version__
from musegl_core.chat.messages import ToolDef, parse_messages, parse_tools
from musegl_core.chat.template import TemplateVariables
from musegl_core.config import ServeConfig
from musegl_core.engine.executor import SamplingParams
from musegl_core.errors import ApiError, bad_request
from musegl_core.http import constraints, stopping
from musegl_core.http.logprobs import MAX_TOP_LOGPROBS
from musegl_core.http.request_log import stream_failed
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http.dialect import Dialect
from musegl_core.service import events as ev
from musegl_core.service.conversation import AnswerFormat, Conversation, ToolChoice
from musegl_core.service.generation import Generation
from musegl_core.service.output import LogprobEntries, Output, OutputAssembler, reasoning_tokens
from musegl_core.service.prepare import Plan, prepare, prompt_images, setup_tools
from musegl_core.service.sessions import MAX_CLIENT_KEY, PROMPT_CACHE_KEY_SOURCE as CLIENT_KEY_SOURCE, client_session
from musegl_core.worker import messages as m
from musegl_core.worker.client import WorkerClient

__all__ = ["ChatPlan", "ChatStream", "Output", "ResponseAssembler", "ResponseMeta", "complete", "plan_chat",
           "prompt_images", "reasoning_tokens"]

REASONING_STRENGTHS = ("low", "medium", "high")
MAX_STOPS = 4
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SEED_RANGE = (-(2**63), 2**64 - 1)


def unsupported(param: str, message: str) -> ApiError:
    return bad_request(message, code="unsupported_parameter", param=param)


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

    ``template`` is a template plugin's object (``render``); ``tool_parser``
    the configured :class:`~musegl_core.plugins.specs.ToolParserSpec` or
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
    soft = False
    if session is None and n == 1:  # n choices cannot share one transcript: those run anonymously
        session, soft = client_session(None, [(CLIENT_KEY_SOURCE, key), *client_keys])
    strength, hide_reasoning = reasoning_controls(request)
    variables = template_variables(request.chat_template_kwargs, strength)
    choice, tools = active_tools(request, tool_parser)
    tool_setup = setup_tools(tools, choice, tool_parser)  # a bad tool schema is reported before bad messages
    messages = parse_messages(request.messages)
    answer = constraints.answer_schema(request)
    stream = bool(request.stream)
    constrained = answer is not None or choice.mode in ("required", "named")
    settings = m.Generate(
        id=request_id,
        prompt=(),
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
    return prepare(conversation, request_id=request_id, config=config, template=template, tool_parser=tool_parser,
                   tokenizer=tokenizer, tool_setup=tool_setup)


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


def choice_count(n: int | None, config: ServeConfig, session: str | None) -> int:
    """``n``: 1..``--max-n``; above 1 it must fit the server at all (each
    choice is a request of its own: it takes an admission slot and a session
    slot) and may not name a session (a session holds one transcript, which
    n answers cannot all extend). docs/protocol.md 2.6."""
    if n is None:
        return 1
    if not 1 <= n <= config.max_n:
        raise bad_request(f"'n' must be between 1 and {config.max_n} (--max-n), got {n}", param="n")
    if n > 1:
        if session is not None:
            raise bad_request(
                "'n' above 1 cannot be used with a named session (session_id / X-Session-Id): a session holds "
                "one transcript, and n answers cannot all extend it; send n > 1 without a session",
                param="n",
            )
        fits = min(config.max_inflight_requests, config.max_sessions)
        if n > fits:
            raise bad_request(
                f"'n' = {n} choices can never run at once on this server: each choice takes an admission slot "
                f"(--max-inflight-requests {config.max_inflight_requests}) and a session slot "
                f"(--max-sessions {config.max_sessions}); the most is {fits}",
                param="n",
            )
    return n


def completion_limit(request: s.ChatCompletionRequest | s.CompletionRequest) -> int | None:
    """``max_completion_tokens`` or its deprecated twin ``max_tokens``; both must
    be positive and agree when both are given. ``None`` leaves the limit to the
    context budget."""
    limit = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, name, None)  # /v1/completions has only max_tokens
        if value is None:
            continue
        if value < 1:
            raise bad_request(f"'{name}' must be a positive integer, got {value}", param=name)
        if limit is not None and value != limit:
            raise bad_request(
                f"'max_tokens' ({value}) and 'max_completion_tokens' ({limit}) disagree; send one",
                param=name,
            )
        limit = value
    return limit


def sampling_params(request: s.ChatCompletionRequest | s.CompletionRequest) -> SamplingParams:
    """temperature in [0, 2], top_p in (0, 1], top_k >= 0, a 64-bit seed, and
    the processors of docs/constrained.md: ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0, ``min_p`` in
    [0, 1], ``logit_bias`` (at most 300 token ids, each biased by -100..100).
    Out of range is a 400 naming the parameter."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = 0 if request.top_k is None else request.top_k
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be between 0 and 2, got {temperature}", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    if top_k < 0:
        raise bad_request(f"'top_k' must be 0 (off) or positive, got {top_k}", param="top_k")
    seed = request.seed
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad_request("'seed' must fit in 64 bits", param="seed")
    penalties = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name, None)
        if value is not None:
            if not -2.0 <= value <= 2.0:
                raise bad_request(f"'{name}' must be between -2 and 2, got {value}", param=name)
            penalties[name] = float(value)
    repetition = getattr(request, "repetition_penalty", None)
    if repetition is not None:
        if not 0.0 < repetition <= 1e6 or repetition != repetition:
            raise bad_request(f"'repetition_penalty' must be greater than 0, got {repetition}",
                              param="repetition_penalty")
        penalties["repetition_penalty"] = float(repetition)
    min_p = getattr(request, "min_p", None)
    if min_p is not None:
        if not 0.0 <= min_p <= 1.0:
            raise bad_request(f"'min_p' must be between 0 and 1, got {min_p}", param="min_p")
        penalties["min_p"] = float(min_p)
    return SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed,
                          logit_bias=logit_bias(getattr(request, "logit_bias", None)), **penalties)


MAX_LOGIT_BIAS = 300


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: token id (a decimal string) -> bias in [-100, 100],
    at most 300 entries; sorted by id. The worker checks the ids against the vocabulary."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' takes at most {MAX_LOGIT_BIAS} entries, got {len(bias)}",
                          param="logit_bias")
    out = []
    for key, value in bias.items():
        if not key.isdigit() or len(key) > 9:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise bad_request(f"'logit_bias' values must be between -100 and 100, got {value} for {key}",
                              param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """A string or up to four non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    for i, text in enumerate(stops):
        if not text:
            raise bad_request("stop strings must not be empty", param="stop" if isinstance(stop, str) else f"stop[{i}]")
    return tuple(dict.fromkeys(stops))


def session_id(body: str | None, header: str | None) -> str | None:
    """The session named by ``session_id`` or ``X-Session-Id``."""
    for value, param in ((body, "session_id"), (header, "X-Session-Id")):
        if value is not None and not SESSION_ID.fullmatch(value):
            raise bad_request(
                f"'{param}' must be 1-128 characters of A-Z a-z 0-9 . _ : -", param=param
            )
    if body is not None and header is not None and body != header:
        raise bad_request("the body's session_id and the X-Session-Id header differ", param="session_id")
    return body if body is not None else header


def prompt_cache_key(value: str | None) -> str | None:
    """``prompt_cache_key``: a non-empty string of at most :data:`MAX_CLIENT_KEY` characters."""
    if value is None:
        return None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_CLIENT_KEY:
        raise bad_request(f"'prompt_cache_key' must be a string of 1-{MAX_CLIENT_KEY} characters",
                          param="prompt_cache_key")
    return value


def cache_salt(value: str | None) -> str | None:
    """``cache_salt``: a non-empty string of at most :data:`~musegl_core.http.schemas.MAX_CACHE_SALT`
    characters (any characters: it is hashed, never shown)."""
    if value is not None and not 1 <= len(value) <= s.MAX_CACHE_SALT:
        raise bad_request(f"'cache_salt' must be a string of 1-{s.MAX_CACHE_SALT} characters, got {len(value)}",
                          param="cache_salt")
    return value


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
    mode, named = constraints.tool_choice_mode(request.tool_choice)
    choice = ToolChoice(mode, named, parallel=request.parallel_tool_calls is not False)
    if request.tools and mode != "none" and tool_parser is None:
        raise unsupported("tools", "tool calling is not enabled on this server (start it with --tool-parser)")
    return choice, list(parse_tools(request.tools)) if request.tools else []


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


async def complete(
    worker: WorkerClient,
    plan: ChatPlan,
    meta: ResponseMeta,
    dialect: Dialect,
    tool_parser: Any = None,
) -> s.ChatCompletion:
    """Run ``plan``'s choices to the end and build the non-streaming response.
    An error of any choice fails the response (the others are cancelled)."""
    generation = Generation(worker, plan, tool_parser)
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

    def __init__(
        self,
        worker: WorkerClient,
        plan: ChatPlan,
        meta: ResponseMeta,
        dialect: Dialect,
        tool_parser: Any = None,
        preflight_timeout: float | None = None,
    ):
        self.plan = plan
        self.meta = meta
        self.dialect = dialect
        self.generation = Generation(worker, plan, tool_parser, preflight_timeout)
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
            items.append(sse.data_event(s.to_json(chunk)))
            return items
        usage = combined_usage(self._usages) if self.plan.include_usage else None
        items += [sse.data_event(s.to_json(c)) for c in self.dialect.stream_tail(chunk, usage)]
        items.append(sse.DONE)
        return items

    def _logprobs(self, entries: LogprobEntries | None) -> s.ChoiceLogprobs | None:
        return wire_logprobs(entries, self.plan.hide_reasoning)

    def _chunk(self, choice: s.ChunkChoice) -> bytes:
        return sse.data_event(s.to_json(self.meta.chunk([choice])))

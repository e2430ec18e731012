"""Chat completions: from a validated request to a worker ``Generate``, and from
worker events to responses.

:func:`plan_chat` applies every request rule that does not
need the model (ranges, contradictions, the reject list, tools without a
parser), renders the conversation with the chat template and returns a
:class:`ChatPlan`. Nothing is submitted before it returns, so every bad
request is a 400 that never reaches the worker.

:class:`ResponseAssembler` turns the worker's ``Tokens``/``Done`` events into
message text through the channel parser (and the tool parser, when one is
active) and keeps the usage accounting. :func:`complete` builds the
non-streaming object; :class:`ChatStream` produces the SSE
events, sending nothing until the worker reports ``Started``. Both run the
request's ``n`` choices as a :class:`~musegl_core.http.choices.ChoiceGroup`
(one worker request per choice, sharing the prompt's KV blocks), with one
assembler per choice.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import attrs

from musegl_core import __version__
from musegl_core.chat import channels
from musegl_core.chat.messages import ToolDef, image_parts, parse_messages, parse_tools
from musegl_core.chat.template import TemplateVariables
from musegl_core.config import ServeConfig
from musegl_core.engine.detokenize import IncrementalDetokenizer
from musegl_core.engine.executor import SamplingParams
from musegl_core.engine.request import ImageInput
from musegl_core.errors import ApiError, bad_request, unavailable
from musegl_core.http import constraints
from musegl_core.http.choices import ChoiceGroup, GroupStream, choice_requests
from musegl_core.http.logprobs import MAX_TOP_LOGPROBS, LogprobTracker
from musegl_core.http import schemas as s
from musegl_core.http import sse
from musegl_core.http.dialect import Dialect
from musegl_core.worker import messages as m
from musegl_core.vision.preprocess import image_too_large
from musegl_core.worker.client import WorkerClient

REASONING_STRENGTHS = ("low", "medium", "high")
MAX_STOPS = 4
SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
SEED_RANGE = (-(2**63), 2**64 - 1)


def unsupported(param: str, message: str) -> ApiError:
    return bad_request(message, code="unsupported_parameter", param=param)


# -- planning ---------------------------------------------------------------------------
@attrs.frozen
class ChatPlan:
    """A request that passed every front-side check, ready for the worker."""

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

    def requests(self) -> list[m.Generate]:
        """One worker request per choice (:func:`~musegl_core.http.choices.choice_requests`)."""
        return choice_requests(self.generate, self.n)


def plan_chat(
    request: s.ChatCompletionRequest,
    *,
    request_id: str,
    config: ServeConfig,
    template: Any,
    tool_parser: Any = None,
    header_session_id: str | None = None,
    tokenizer: Any = None,
) -> ChatPlan:
    """Validate ``request`` and render its prompt; raises :class:`ApiError` (400).

    ``template`` is a template plugin's object (``render``); ``tool_parser``
    the configured :class:`~musegl_core.plugins.specs.ToolParserSpec` or
    ``None`` (tools without ``--tool-parser`` are refused).
    """
    _check_fixed_choices(request)
    max_tokens = completion_limit(request)
    sampling = sampling_params(request)
    stops = stop_strings(request.stop)
    session = session_id(request.session_id, header_session_id)
    salt = cache_salt(request.cache_salt)
    n = choice_count(request.n, config, session)
    strength, hide_reasoning = reasoning_controls(request)
    variables = template_variables(request.chat_template_kwargs, strength)
    tools_active, tools = active_tools(request, tool_parser)
    prepared_tools = prepare_tools(tool_parser, tools) if tools_active else None
    messages = parse_messages(request.messages)
    rendered = template.render(messages, tools, tools_active=tools_active, variables=variables)
    top_logprobs = (request.top_logprobs or 0) if request.logprobs else -1
    if top_logprobs >= 0 and tokenizer is None:
        raise unavailable("logprobs need the served tokenizer, which the front could not load", code="model_loading")
    mode, named = constraints.tool_choice_mode(request.tool_choice)
    grammar = constraints.output_grammar(
        request, config=config, mode=mode, named=named, tools_active=tools_active, tools=tools,
        tool_parser=tool_parser, prepared_tools=prepared_tools, aliases=dict(rendered.tool_aliases),
    )
    lazy_grammar = None if grammar is not None else constraints.lazy_call_grammar(
        mode=mode, tools_active=tools_active, tools=tools, tool_parser=tool_parser, prepared_tools=prepared_tools,
        aliases=dict(rendered.tool_aliases),
    )
    images = prompt_images(messages, config.max_image_bytes)
    stream = bool(request.stream)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    ignore_eos = bool(request.ignore_eos)
    generate = m.Generate(
        id=request_id,
        prompt=tuple(rendered.segments),
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        ignore_eos=ignore_eos,
        session_id=session,
        cache_salt=salt,
        stream=stream,
        grammar=grammar,
        lazy_grammar=lazy_grammar,
        logprobs=top_logprobs,
        images=images,
    )
    return ChatPlan(
        generate=generate,
        stream=stream,
        include_usage=include_usage,
        hide_reasoning=hide_reasoning,
        ignore_eos=ignore_eos,
        tools_active=tools_active,
        tools=tuple(tools),
        tool_aliases=dict(rendered.tool_aliases),
        prepared_tools=prepared_tools,
        image_count=rendered.image_count,
        logprobs=top_logprobs,
        tokenizer=tokenizer if top_logprobs >= 0 else None,
        n=n,
    )


def prompt_images(messages, max_image_bytes: int) -> tuple[ImageInput, ...]:
    """The images the worker decodes, in prompt order; a compressed image over
    ``--max-image-bytes`` is a 413 ``image_too_large`` here, before it travels."""
    images = []
    for part in image_parts(messages):
        if len(part.data) > max_image_bytes:
            raise image_too_large(len(part.data), max_image_bytes)
        images.append(ImageInput(part.media_type, part.url.split(",", 1)[1], part.detail))
    return tuple(images)


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


def active_tools(request: s.ChatCompletionRequest, tool_parser: Any) -> tuple[bool, list[ToolDef]]:
    """Whether tools are active, and the declared tools."""
    choice, _ = constraints.tool_choice_mode(request.tool_choice)
    if not request.tools:
        if choice in ("required", "named"):
            raise bad_request("a 'tool_choice' that requires a call needs 'tools'", param="tool_choice")
        return False, []
    if choice == "none":
        return False, list(parse_tools(request.tools))
    if tool_parser is None:
        raise unsupported("tools", "tool calling is not enabled on this server (start it with --tool-parser)")
    return True, list(parse_tools(request.tools))


def prepare_tools(tool_parser: Any, tools: list[ToolDef]) -> Any:
    """Run the tool parser's preflight (schema checks) on the active
    tools; it raises :class:`ApiError` (400) and returns what ``create`` reuses."""
    return tool_parser.prepare(tools) if tool_parser.prepare is not None else None


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


def reasoning_tokens(message_starts: list[tuple[int, str]], generated_chars: Sequence[int]) -> int:
    """How many generated ids belong to reasoning messages (docs/protocol.md: reasoning tokens).

    Which ids count: every id of a ``to=self`` message, from the start of its
    header position (the whitespace and header that open it) through its
    structural terminator, including text that continues it after a
    terminator and, when generation ends inside it, the end-of-generation id.
    Ids of visible and tool messages do not count; neither do ids of an
    incomplete header at the end of the output (they stay with the message
    before them).

    How: the worker reports, per generated id, how many characters its
    detokenizer added when that id arrived (``Done.generated_chars``; the id
    that starts a multi-byte character gets the character). The running sum
    is the character offset at which each id begins in the worker's text, so
    the channel parser's :attr:`~musegl_core.chat.channels.ChannelParser.message_starts`
    tell each id's message. No id is detokenized twice.
    """
    count, offset = 0, 0
    for chars in generated_chars:
        count += channels.channel_at(message_starts, offset) == "reasoning"
        offset += chars
    return count


@attrs.define
class Output:
    """What one batch of worker text adds to the response."""

    reasoning: str = ""
    content: str = ""


class ResponseAssembler:
    """Turns worker events into message text, tool calls and usage.

    The channel parser splits the output into reasoning, visible content and
    tool-addressed text; tool-addressed text goes to the
    tool parser when tools are active. Hidden reasoning is still parsed (and
    counted), it is only not returned.
    """

    def __init__(self, plan: ChatPlan, tool_parser: Any = None):
        self.plan = plan
        self.parser = channels.ChannelParser(tools_active=plan.tools_active, hide_reasoning=False)
        self.tools = (
            tool_parser.create(list(plan.tools), {"aliases": plan.tool_aliases, "prepared": plan.prepared_tools})
            if plan.tools_active and tool_parser is not None
            else None
        )
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[s.ToolCall] = []
        self.logprobs = (
            LogprobTracker(plan.tokenizer, plan.tools_active, plan.logprobs)
            if plan.logprobs >= 0 and plan.tokenizer is not None
            else None
        )
        self._sent = (0, 0)  # logprob entries already streamed (content, reasoning)

    def feed(self, event: m.Tokens) -> Output:
        """Parse the text of one ``Tokens`` event; returns the visible deltas."""
        if self.logprobs is not None:
            self.logprobs.feed(event.ids, event.logprobs, event.text, self.plan.ignore_eos)
        return self._visible(self._route(self.parser.feed(event.text)))

    def choice_logprobs(self, unsent: bool = False) -> s.ChoiceLogprobs | None:
        """The ``logprobs`` of the choice (``unsent``: only entries not streamed yet)."""
        if self.logprobs is None:
            return None
        content, reasoning = self.logprobs.content, self.logprobs.reasoning
        if unsent:
            sent_c, sent_r = self._sent
            self._sent = (len(content), len(reasoning))
            content, reasoning = content[sent_c:], reasoning[sent_r:]
        hidden = self.plan.hide_reasoning
        return s.ChoiceLogprobs(content=list(content), reasoning_content=None if hidden else list(reasoning))

    def finish(self, done: m.Done) -> tuple[Output, str]:
        """Flush the parsers at the end of generation; returns the last deltas
        and the finish reason. A failed tool-call set raises :class:`ApiError`."""
        end = _end_of_generation(done)
        if self.logprobs is not None:
            self.logprobs.finish(end)
        out = self._route(self.parser.finish(end), at_end=True)
        reason = "length" if done.finish_reason == "length" else "stop"
        if self.tools is not None:
            calls = self.tools.finish(end) or []
            self.tool_calls = [_tool_call(call, i) for i, call in enumerate(calls)]
            if self.tool_calls:
                reason = "tool_calls"
        return self._visible(out), reason

    def usage(self, done: m.Done) -> s.Usage:
        """The usage object. ``reasoning_tokens`` only from the exact
        generated ids: omitted when the worker did not report them (a
        stop-trimmed turn) and with ``ignore_eos``."""
        details = None
        if done.generated_chars is not None and not self.plan.ignore_eos:
            reasoning = reasoning_tokens(self.parser.message_starts, done.generated_chars)
            details = s.CompletionTokensDetails(reasoning_tokens=reasoning)
        return s.Usage(
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            total_tokens=done.prompt_tokens + done.completion_tokens,
            prompt_tokens_details=s.PromptTokensDetails(cached_tokens=done.cached_tokens),
            completion_tokens_details=details,
        )

    def _route(self, events: list[Any], at_end: bool = False) -> Output:
        """Split channel events into text and tool events; tool events go to
        the tool parser (``at_end``: they were settled by the end of output)."""
        out = Output()
        for event in events:
            if isinstance(event, channels.ReasoningDelta):
                out.reasoning += event.text
            elif isinstance(event, channels.ContentDelta):
                out.content += event.text
            elif isinstance(event, (channels.ToolDelta, channels.ToolMessageEnd)) and self.tools is not None:
                self.tools.feed(event, at_end=at_end)
        self.reasoning.append(out.reasoning)
        self.content.append(out.content)
        return out

    def _visible(self, out: Output) -> Output:
        return Output("", out.content) if self.plan.hide_reasoning else out

    def message(self, dialect: Dialect) -> s.AssistantMessage:
        """The non-streaming message."""
        reasoning = "".join(self.reasoning)
        content = "".join(self.content)
        hidden = self.plan.hide_reasoning or not reasoning
        return s.AssistantMessage(
            content=content if content or not self.tool_calls else None,
            tool_calls=self.tool_calls or None,
            **dialect.reasoning_fields(None if hidden else reasoning),
        )


def _end_of_generation(done: m.Done) -> str:
    """The channel parser's end kind: ``eos``, ``stop`` (a request stop),
    ``length`` or ``cancel``."""
    if done.finish_reason == "length":
        return "length"
    if done.finish_reason == "cancelled":
        return "cancel"
    return "stop" if done.matched_stop is not None else "eos"


def _tool_call(call: Any, index: int) -> s.ToolCall:
    """A validated call from the tool parser as a response ``tool_calls`` entry."""
    arguments = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
    call_id = getattr(call, "id", None) or f"call_{uuid.uuid4().hex[:24]}"
    return s.ToolCall(id=call_id, function=s.FunctionCall(name=call.name, arguments=arguments))


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


def _ended_early() -> ApiError:
    return unavailable("the model worker ended the request without a result", code="worker_restarting")


async def complete(
    worker: WorkerClient,
    plan: ChatPlan,
    meta: ResponseMeta,
    dialect: Dialect,
    tool_parser: Any = None,
) -> s.ChatCompletion:
    """Run ``plan``'s choices to the end and build the non-streaming response.
    An error of any choice fails the response (the others are cancelled)."""
    assemblers = [ResponseAssembler(plan, tool_parser) for _ in range(plan.n)]
    choices: list[s.Choice | None] = [None] * plan.n
    usages: list[s.Usage | None] = [None] * plan.n
    group = ChoiceGroup(worker, plan.requests())
    await group.open()
    try:
        async for index, event in group.events():
            assembler = assemblers[index]
            if isinstance(event, m.Tokens):
                assembler.feed(event)
            elif isinstance(event, m.Done):
                _, reason = assembler.finish(event)
                choices[index] = s.Choice(message=assembler.message(dialect), finish_reason=reason, index=index,
                                          logprobs=assembler.choice_logprobs())
                usages[index] = assembler.usage(event)
    finally:
        await group.close()
    if any(choice is None for choice in choices):
        raise _ended_early()
    return s.ChatCompletion(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        system_fingerprint=meta.system_fingerprint,
        choices=list(choices),
        usage=combined_usage(usages),
    )


class ChatStream(GroupStream):
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
        super().__init__(worker, plan.requests(), dialect, preflight_timeout)
        self.worker = worker
        self.plan = plan
        self.meta = meta
        self.assemblers = [ResponseAssembler(plan, tool_parser) for _ in range(plan.n)]
        self._usages: list[s.Usage | None] = [None] * plan.n

    @property
    def assembler(self) -> ResponseAssembler:
        """Choice 0's assembler."""
        return self.assemblers[0]

    async def _body(self) -> AsyncIterator[bytes]:
        try:
            for index in range(self.plan.n):
                yield self._chunk(s.ChunkChoice(delta=s.RoleDelta(), index=index))
            remaining = self.plan.n
            try:
                async for index, event in self.group.events():
                    if isinstance(event, m.Tokens):
                        for item in self._deltas(index, self.assemblers[index].feed(event)):
                            yield item
                    elif isinstance(event, m.Done):
                        remaining -= 1
                        for item in self._finish(index, event, last=remaining == 0):
                            yield item
                if remaining == 0:
                    return
                error = _ended_early()
            except ApiError as exc:
                error = exc
            await self.close()  # cancel the other choices before telling the client
            for item in self.dialect.stream_error(error, self.meta.chunk([])):
                yield item
        finally:
            await self.close()

    def _finish(self, index: int, done: m.Done, last: bool) -> list[bytes]:
        """A choice's last deltas, tool calls and finish chunk; after the last
        choice, the usage (per the dialect) and ``[DONE]``."""
        assembler = self.assemblers[index]
        out, reason = assembler.finish(done)
        items = self._deltas(index, out)
        if assembler.tool_calls:
            calls = [
                s.ToolCallDelta(index=i, id=call.id, function=call.function)
                for i, call in enumerate(assembler.tool_calls)
            ]
            items.append(self._chunk(s.ChunkChoice(delta=s.Delta(tool_calls=calls), index=index)))
        self._usages[index] = assembler.usage(done)
        rest = assembler.choice_logprobs(unsent=True)
        if rest is not None and not (rest.content or rest.reasoning_content):
            rest = None
        finish = self.meta.chunk([s.ChunkChoice(delta=s.Delta(), finish_reason=reason, index=index, logprobs=rest)])
        if not last:
            items.append(sse.data_event(s.to_json(finish)))
            return items
        usage = combined_usage(self._usages) if self.plan.include_usage else None
        items += [sse.data_event(s.to_json(chunk)) for chunk in self.dialect.stream_tail(finish, usage)]
        items.append(sse.DONE)
        return items

    def _deltas(self, index: int, out: Output) -> list[bytes]:
        """Reasoning then content deltas of one choice; never an empty one."""
        items = []
        assembler = self.assemblers[index]
        logprobs = assembler.choice_logprobs(unsent=True) if out.reasoning or out.content else None
        if out.reasoning:
            items.append(self._chunk(s.ChunkChoice(delta=s.Delta(**self.dialect.reasoning_fields(out.reasoning)),
                                                   index=index, logprobs=logprobs)))
            logprobs = None
        if out.content:
            items.append(self._chunk(s.ChunkChoice(delta=s.Delta(content=out.content), index=index,
                                                   logprobs=logprobs)))
        return items

    def _chunk(self, choice: s.ChunkChoice) -> bytes:
        return sse.data_event(s.to_json(self.meta.chunk([choice])))

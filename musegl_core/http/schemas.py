"""The Chat Completions wire format: attrs classes and their cattrs converter.

Requests are structured from the raw JSON body with :data:`converter`, whose
primitive hooks are *strict* (``"5"`` is not an integer, ``1`` is not a
boolean, a string is not a list), so a wrong field type becomes a 400 that
names the field (:func:`structure_request`). Responses are unstructured with
the same converter; fields declared with :func:`omittable` disappear from the
JSON when they are ``None`` (``reasoning_content``, ``tool_calls``, ...),
while ordinary ``None`` fields are written as ``null`` (the role chunk's
``content``, ``finish_reason`` of a delta chunk).

The shapes are those of OpenAI's Chat Completions API with musegl's
additions (docs/protocol.md).
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any, Callable, NoReturn, TypeVar, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory, mapping_structure_factory
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from musegl_core.errors import ApiError, bad_request
from musegl_core.http.body import load_json_object

T = TypeVar("T")
_OMIT_NONE = OMIT_NONE = "musegl_omit_none"
_FORBID_EXTRA = FORBID_EXTRA = "__musegl_forbid_extra_keys__"
#: attrs field metadata: the field's JSON Schema where its type says too little (OpenAPI)
JSON_SCHEMA = "musegl_json_schema"

_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_IMAGE_PART = {
    "type": "object",
    "properties": {
        "type": {"const": "image_url"},
        "image_url": {
            "type": "object",
            "properties": {
                "url": {"type": "string", "description": "data:image/png;base64,... or JPEG"},
                "detail": {"anyOf": [{"enum": ["auto", "low", "high"]}, {"type": "null"}],
                           "description": "low: at most 256 patches; auto, high: --max-vision-patches"},
            },
            "required": ["url"],
        },
    },
    "required": ["type", "image_url"],
}
#: The shape of ``messages`` (the chat package checks the rest and answers 400).
MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "null"},
                    {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                ]
            },
            "name": {"type": "string"},
            "tool_call_id": {"type": "string"},
            "reasoning_content": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "tool_calls": {"anyOf": [{"type": "array", "items": {"type": "object"}}, {"type": "null"}]},
        },
        "required": ["role"],
    },
}


def messages_field() -> Any:
    """``messages``: raw JSON here, documented by :data:`MESSAGES_SCHEMA`."""
    return attrs.field(default=None, metadata={JSON_SCHEMA: MESSAGES_SCHEMA})


#: ``cache_salt``: the longest salt accepted (characters)
MAX_CACHE_SALT = 256


def cache_salt_field() -> Any:
    """``cache_salt`` (vLLM's field): requests share cached KV only with requests
    of the same salt; absent is the shared unsalted space (docs/serving.md)."""
    return attrs.field(default=None, metadata={JSON_SCHEMA: {
        "anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT}, {"type": "null"}],
        "description": "prefix-cache isolation: KV is reused only between requests with the same salt",
    }})


def omittable(default: Any = None) -> Any:
    """An attrs field that is left out of the JSON while it is ``None``."""
    return attrs.field(default=default, metadata={_OMIT_NONE: True})


def closed(cls: type) -> type:
    """Mark an attrs request class whose unknown keys are an error (``reasoning``,
    ``chat_template_kwargs``); the 400 names the unknown key."""
    setattr(cls, _FORBID_EXTRA, True)
    return cls


# -- requests --------------------------------------------------------------------------
@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None


@closed
@attrs.frozen
class ReasoningOptions:
    """OpenRouter's ``reasoning`` object as musegl accepts it."""

    effort: str | None = None
    exclude: bool | None = None
    enabled: bool | None = None


@closed
@attrs.frozen
class ChatTemplateKwargs:
    """The template variables a client may set."""

    current_date: str | None = None
    knowledge_cutoff: str | None = None
    reasoning_strength: str | None = None
    tool_namespace_descriptions: dict[str, str] | None = None


@closed
@attrs.frozen
class ResponseFormat:
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``;
    ``json_schema`` (``name``, ``schema``, ``strict``, ``description``) stays raw
    JSON here, :mod:`musegl_core.http.constraints` checks it. ``schema`` is
    llama.cpp's ``{"type": "json_object", "schema": {...}}``, honoured as a
    json_schema. Other keys are refused (400 naming them), never ignored."""

    type: str
    json_schema: Any = None
    schema: Any = None


StopField = str | list[str] | None


@attrs.frozen
class ChatCompletionRequest:
    """A ``POST /v1/chat/completions`` body after type checks.

    ``messages``, ``tools`` and ``tool_choice`` stay raw JSON here: the chat
    package validates them with its own, more specific errors. Fields on the
    reject list (:data:`REJECTED_FIELDS`) are checked on the raw body before structuring
    (:func:`structure_request`). Range and consistency rules live in
    :mod:`musegl_core.http.completions`.
    """

    messages: Any = messages_field()
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: StopField = None
    ignore_eos: bool | None = None
    session_id: str | None = None
    prompt_cache_key: str | None = None  # OpenAI's conversation key: names a soft session (docs/sessions.md)
    cache_salt: str | None = cache_salt_field()
    reasoning_effort: str | None = None
    reasoning: ReasoningOptions | None = None
    include_reasoning: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    json_schema: Any = None  # llama.cpp's top-level spelling of response_format json_schema
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    stop_token_ids: list[int] | None = None  # vLLM's: ids that end generation
    min_tokens: int | None = None  # vLLM's: end ids and stops are held off before this many tokens
    #: vLLM's: true leaves the special tokens the output grammar does not use out of the text
    #: (routers add it: docs/scaling.md); false or absent writes them out
    skip_special_tokens: bool | None = None


# Present with a non-null value → 400 unsupported_parameter.
REJECTED_FIELDS = (
    "thinking_token_budget",
    "grammar",
    "stop_regex",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
    "grammar_lazy",
    "grammar_triggers",
    "prompt_logprobs",  # vLLM: logprobs of the prompt's ids
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "n_probs",  # llama.cpp: use logprobs / top_logprobs
    "n_predict",  # llama.cpp: use max_tokens
)

#: Accepted only at the value that changes nothing (absent or null too); any
#: other value → 400 unsupported_parameter (as ``/v1/completions`` does).
FIXED_FIELDS = {
    "best_of": 1,
    "echo": False,
    # SGLang's request fields, which vllm-router and sglang-router add to every chat body they
    # forward (docs/scaling.md), at the value that describes what musegl does: a matched stop is
    # trimmed, reasoning comes apart from the content and streams as it is generated, no hidden states
    "no_stop_trim": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}


PromptField = str | list[str] | list[int] | list[list[int]] | None


@attrs.frozen
class CompletionRequest:
    """A ``POST /v1/completions`` body after type checks.

    ``prompt`` is raw text (special tokens written out) or token ids; one
    prompt per request. ``echo``, ``best_of``, ``suffix``, ``logprobs``,
    ``session_id`` and the fields after it are typed here only so that a
    value the engine cannot honour is refused by name
    (``musegl_core.http.text_completions``).
    """

    prompt: PromptField = None
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: StopField = None
    ignore_eos: bool | None = None
    n: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    user: str | None = None
    cache_salt: str | None = cache_salt_field()
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    # refused by name when present (``text_completions.REFUSED_FIELDS``): not honoured here
    session_id: Any = None
    prompt_logprobs: Any = None
    skip_special_tokens: bool | None = None  # true: no special token in the text
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    n_probs: Any = None
    n_predict: Any = None


@attrs.frozen
class TokenizeRequest:
    """``POST /tokenize``: ``prompt`` (raw text, as ``/v1/completions`` reads it)
    or ``messages`` (rendered with the chat template, as a chat request would be;
    the chat fields that shape the prompt may come along)."""

    prompt: str | None = None
    messages: Any = messages_field()
    model: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning_effort: str | None = None
    reasoning: ReasoningOptions | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


@attrs.frozen
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


# -- responses -------------------------------------------------------------------------
@attrs.frozen
class FunctionCall:
    name: str
    arguments: str  # a JSON object, as a string


@attrs.frozen
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen
class ToolCallDelta:
    """A complete, validated call in a stream (arguments are not streamed piecemeal)."""

    index: int
    id: str
    function: FunctionCall
    type: str = "function"


@attrs.frozen
class AssistantMessage:
    content: str | None
    role: str = "assistant"
    reasoning_content: str | None = omittable()
    reasoning: str | None = omittable()  # the openrouter dialect's second name
    tool_calls: list[ToolCall] | None = omittable()


@attrs.frozen
class ChoiceLogprobs:
    """``logprobs`` of a choice: ``content`` entries (their ``token`` texts
    concatenate to the content) and, musegl's addition, ``reasoning_content``
    entries for the reasoning (absent when reasoning is hidden)."""

    content: list[Any] | None = None
    reasoning_content: list[Any] | None = omittable()


@attrs.frozen
class Choice:
    message: AssistantMessage
    finish_reason: str
    index: int = 0
    logprobs: ChoiceLogprobs | None = omittable()


@attrs.frozen
class PromptTokensDetails:
    cached_tokens: int = 0


@attrs.frozen
class CompletionTokensDetails:
    reasoning_tokens: int = 0


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()
    completion_tokens_details: CompletionTokensDetails | None = omittable()


@attrs.frozen
class ChatCompletion:
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"


@attrs.frozen
class RoleDelta:
    """The first delta of a stream: ``content`` is present and ``null``."""

    role: str = "assistant"
    content: None = None


@attrs.frozen
class Delta:
    """A later delta: only the fields it carries (``{}`` for the finish chunk)."""

    content: str | None = omittable()
    reasoning_content: str | None = omittable()
    reasoning: str | None = omittable()
    tool_calls: list[ToolCallDelta] | None = omittable()


@attrs.frozen
class ChunkChoice:
    delta: RoleDelta | Delta
    finish_reason: str | None = None
    index: int = 0
    logprobs: ChoiceLogprobs | None = omittable()


@attrs.frozen
class ChatCompletionChunk:
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = omittable()
    object: str = "chat.completion.chunk"


@attrs.frozen
class CompletionChoice:
    text: str
    finish_reason: str | None
    index: int = 0
    logprobs: None = None


@attrs.frozen
class TextCompletion:
    """``/v1/completions`` (``object`` ``text_completion``, also for stream chunks)."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = omittable()
    object: str = "text_completion"


@attrs.frozen
class TokenizeResult:
    tokens: list[int]
    count: int
    max_model_len: int


@attrs.frozen
class DetokenizeResult:
    prompt: str


@attrs.frozen
class ModelEntry:
    """One ``/v1/models`` entry. ``context_length`` and ``max_model_len`` are both
    the runtime ``--max-context`` budget; ``input_modalities`` is
    ``["text", "image"]`` when a vision projector is loaded, else ``["text"]``;
    ``demo`` marks the built-in random-weight demo model. ``type``,
    ``display_name`` and ``created_at`` (RFC 3339) are the fields Anthropic's
    model object has, so both SDKs read the same entry."""

    id: str
    created: int
    context_length: int
    max_model_len: int
    input_modalities: list[str] = attrs.Factory(lambda: ["text"])
    object: str = "model"
    owned_by: str = "musegl"
    type: str = "model"
    display_name: str | None = omittable()
    created_at: str | None = omittable()
    demo: bool | None = omittable()
    description: str | None = omittable()


def rfc3339(seconds: int) -> str:
    """Unix seconds as Anthropic's ``created_at`` (``2026-12-01T20:56:25Z``)."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.frozen
class ModelList:
    """``/v1/models``. Entries are written by their own class, so a dialect may
    return a richer entry than :class:`ModelEntry` (the OpenRouter model shape).
    ``has_more``, ``first_id`` and ``last_id`` are the page fields of
    Anthropic's list (one page: every entry)."""

    data: list[Any]
    object: str = "list"
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


@attrs.frozen
class HealthStatus:
    status: str = "ok"


@attrs.frozen
class ErrorObject:
    """OpenAI's error object (the openai dialect)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


@attrs.frozen
class ErrorBody:
    error: ErrorObject


# -- the converter ---------------------------------------------------------------------
converter = cattrs.Converter()


def _strict(kind: type, accepts: Any, expected: str) -> None:
    def hook(value: Any, _: Any) -> Any:
        if not accepts(value):
            raise TypeError(f"expected {expected}")
        return float(value) if kind is float else value

    converter.register_structure_hook(kind, hook)


_strict(bool, lambda v: isinstance(v, bool), "a boolean")
_strict(int, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
_strict(float, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")
_strict(str, lambda v: isinstance(v, str), "a string")


def _is_list(t: Any) -> bool:
    return get_origin(t) is list


def _strict_list(t: Any, conv: cattrs.Converter) -> Any:
    inner = list_structure_factory(t, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, list):
            raise TypeError("expected an array")
        return inner(value, t)

    return hook


def _is_dict(t: Any) -> bool:
    return get_origin(t) is dict


def _strict_dict(t: Any, conv: cattrs.Converter) -> Any:
    inner = mapping_structure_factory(t, conv)

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("expected an object")
        return inner(value, t)

    return hook


def _strict_attrs(cls: type, conv: cattrs.Converter) -> Any:
    inner = make_dict_structure_fn(
        cls, conv, _cattrs_forbid_extra_keys=getattr(cls, _FORBID_EXTRA, False)
    )

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("expected an object")
        return inner(value, cls)

    return hook


def _structure_stop(value: Any, _: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    return converter.structure(value, list[str])


converter.register_structure_hook_factory(_is_list, _strict_list)
converter.register_structure_hook_factory(_is_dict, _strict_dict)
converter.register_structure_hook_factory(attrs.has, _strict_attrs)
converter.register_structure_hook_func(lambda t: t is StopField, _structure_stop)


def _structure_prompt(value: Any, _: Any) -> str | list[str] | list[int] | list[list[int]] | None:
    """A string, token ids, or a list of either (``prompt`` of ``/v1/completions``)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise TypeError("expected a string or an array")
    if all(isinstance(item, str) for item in value):
        return list(value)
    if all(isinstance(item, list) for item in value):
        return converter.structure(value, list[list[int]])
    return converter.structure(value, list[int])


converter.register_structure_hook_func(lambda t: t is PromptField, _structure_prompt)


def _omitting_unstructure(cls: type, conv: cattrs.Converter) -> Any:
    base = make_dict_unstructure_fn(cls, conv)
    optional = [f.name for f in attrs.fields(cls) if f.metadata.get(_OMIT_NONE)]
    if not optional:
        return base

    def hook(obj: Any) -> dict[str, Any]:
        payload = base(obj)
        for name in optional:
            if payload.get(name) is None:
                payload.pop(name, None)
        return payload

    return hook


converter.register_unstructure_hook_factory(attrs.has, _omitting_unstructure)


# -- entry points ----------------------------------------------------------------------
def parse_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 ``invalid_request_error``
    (malformed JSON, nesting past ``MAX_JSON_DEPTH``, a lone surrogate:
    :mod:`musegl_core.http.body`)."""
    return load_json_object(body)


def structure_body(payload: dict[str, Any], cls: type[T]) -> T:
    """Type-check ``payload`` into ``cls``; the first bad field is named (400)."""
    try:
        return converter.structure(payload, cls)
    except cattrs.BaseValidationError as exc:
        _refuse(exc)


#: Chat Completions fields of OpenAI's that musegl does not implement, refused by name with what to do.
REFUSED_CHAT_FIELDS = {
    "functions": "the legacy 'functions' are not supported: declare them in 'tools' "
                 "([{\"type\": \"function\", \"function\": {...}}])",
    "function_call": "the legacy 'function_call' is not supported: use 'tool_choice'",
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
}

#: Fields accepted only where they change nothing by their own definition (docs/protocol.md 1.1):
#: each field's check of its value, and the values it takes.
NEUTRAL_CHAT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # an end-user's id for the provider's abuse monitoring: no effect on the output
    "user": (lambda v: isinstance(v, str), "a string"),
    "safety_identifier": (lambda v: isinstance(v, str), "a string"),
    # tags of a stored completion: this server stores none, and 'store' is only false
    "metadata": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                 "an object of strings"),
    "store": (lambda v: v is False, "false (completions are not stored here)"),
    # the processing tier of OpenAI's own service: 'auto' and 'default' both mean the standard one
    "service_tier": (lambda v: v in ("auto", "default"), "'auto' or 'default'"),
    # the output modalities: text is what this server writes
    "modalities": (lambda v: v == ["text"], '["text"]'),
    # the answer's length hint: 'medium' is the model's own default
    "verbosity": (lambda v: v == "medium", "'medium' (the default; other lengths are not supported)"),
}


#: the keys a Chat Completions body may have besides the neutral ones
_CHAT_FIELDS = frozenset(f.name for f in attrs.fields(ChatCompletionRequest)) | set(REJECTED_FIELDS) | set(FIXED_FIELDS)


def refuse_unknown_chat_fields(payload: dict[str, Any]) -> None:
    """Every key of a Chat Completions body is one this server honours, refuses by name, or
    accepts at a value that changes nothing; any other key is 400 ``unsupported_parameter``
    (as Messages and Responses refuse theirs): nothing a client sends is silently ignored."""
    for name, value in payload.items():
        if value is None or name in _CHAT_FIELDS:
            continue
        if name in REFUSED_CHAT_FIELDS:
            raise bad_request(REFUSED_CHAT_FIELDS[name], code="unsupported_parameter", param=name)
        neutral = NEUTRAL_CHAT_FIELDS.get(name)
        if neutral is not None:
            if not neutral[0](value):
                raise bad_request(f"'{name}' is accepted only as {neutral[1]} (or absent)",
                                  code="unsupported_parameter", param=name)
            continue
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise bad_request(f"unknown parameter '{shown}': this server does not implement it",
                          code="unsupported_parameter", param=shown)


def structure_request(payload: dict[str, Any]) -> ChatCompletionRequest:
    """Type-check ``payload`` into a :class:`ChatCompletionRequest`.

    Rejected fields come first; a ``null`` counts as absent
    everywhere. The first offending field is named in the error's ``param``.
    """
    for name in REJECTED_FIELDS:
        if payload.get(name) is not None:
            raise bad_request(
                f"'{name}' is not supported by this server", code="unsupported_parameter", param=name
            )
    for name, value in FIXED_FIELDS.items():
        given = payload.get(name)
        if given is not None and (given != value or type(given) is not type(value)):
            raise bad_request(f"'{name}' is only supported as {json_literal(value)} (or absent)",
                              code="unsupported_parameter", param=name)
    refuse_unknown_chat_fields(payload)
    try:
        return converter.structure(payload, ChatCompletionRequest)
    except cattrs.BaseValidationError as exc:
        _refuse(exc)


def _refuse(exc: cattrs.BaseValidationError) -> NoReturn:
    """Raise the 400 for a structuring failure (:func:`_field_error`) so that the request's
    body is freed as soon as the error is handled, not at the next garbage collection:
    cattrs' generated functions keep their failures in a local list, a cycle through the
    tracebacks whose frames hold the body, so those frames are cleared first; and this
    frame drops the error before it propagates (a frame holding the error its own traceback
    holds would be a cycle too)."""
    error = _field_error(exc)
    pending = [exc]
    while pending:
        failure = pending.pop()
        pending.extend(getattr(failure, "exceptions", ()))
        if failure.__traceback__ is not None:
            traceback.clear_frames(failure.__traceback__)
            failure.__traceback__ = None
    try:
        raise error from None
    finally:
        del error


def json_literal(value: Any) -> str:
    return "true" if value is True else "false" if value is False else str(value)


def _field_error(exc: cattrs.BaseValidationError) -> ApiError:
    """The first structuring failure as a 400 naming its field (``stop[1]``,
    ``stream_options.include_usage``); unknown keys of a closed object are
    ``unsupported_parameter``."""
    unknown = _find_unknown_keys(exc)
    if unknown is not None:
        where, key = unknown
        param = f"{where}.{key}" if where else key
        return bad_request(
            f"'{param}' is not a supported parameter", code="unsupported_parameter", param=param
        )
    first = cattrs.transform_error(exc, path="$")[0]
    reason, _, path = first.rpartition(" @ ")
    param = path.removeprefix("$").lstrip(".") or None
    expected = reason.rpartition("expected ")[2] or "a valid value"
    return bad_request(f"'{param}' has the wrong type: expected {_readable(expected)}", param=param)


def _find_unknown_keys(exc: BaseException, where: str = "") -> tuple[str, str] | None:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return where, sorted(exc.extra_fields)[0]
    if isinstance(exc, cattrs.BaseValidationError):
        for sub in exc.exceptions:
            name = next(
                (getattr(n, "name", None) for n in getattr(sub, "__notes__", ()) if hasattr(n, "name")),
                None,
            )
            found = _find_unknown_keys(sub, f"{where}.{name}".lstrip(".") if name else where)
            if found is not None:
                return found
    return None


def _readable(expected: str) -> str:
    """``int | None`` → ``an integer`` for error messages."""
    names = {
        "int": "an integer",
        "float": "a number",
        "str": "a string",
        "bool": "a boolean",
        "list": "an array",
        "dict": "an object",
    }
    kinds = [k.strip() for k in expected.split("|") if k.strip() != "None"]
    words = [names.get(k.split("[")[0], "an object" if "." in k else k) for k in kinds]
    return " or ".join(dict.fromkeys(words)) or expected


def to_json(obj: Any) -> dict[str, Any]:
    """Unstructure a response object for the wire."""
    return converter.unstructure(obj)


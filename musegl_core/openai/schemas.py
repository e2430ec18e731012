"""The OpenAI wire format of the core's surfaces: attrs classes and their cattrs hooks.

Requests are structured from the raw JSON body with the schema kit's strict
converter (:mod:`musegl_core.http.schemas`), so a wrong field type becomes a
400 that names the field (:func:`structure_request`); the hooks below add the
union fields (``stop``, ``prompt``) to it. Responses are unstructured with the
same converter (:func:`~musegl_core.http.schemas.to_json`).

The shapes are those of OpenAI's Chat Completions and Completions APIs with
musegl's additions (docs/protocol.md).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from musegl_core.errors import bad_request
from musegl_core.http.schemas import (JSON_SCHEMA, cache_salt_field, closed, converter, json_literal, omittable,
                                      structure_body)

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
    JSON here, :mod:`musegl_core.service.constraints` checks it. ``schema`` is
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
    :mod:`musegl_core.openai.chat`.
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
    #: ``in_memory`` or ``24h``: how long the prompt's KV is kept (docs/sessions.md "Retention")
    prompt_cache_retention: str | None = None
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
    (``musegl_core.openai.completions``).
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



# -- the converter's hooks for the union fields --------------------------------------
def _structure_stop(value: Any, _: Any) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value
    return converter.structure(value, list[str])


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


# -- entry points ----------------------------------------------------------------------
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
    return structure_body(payload, ChatCompletionRequest)

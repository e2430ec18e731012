"""A ``POST /v1/responses`` body → a conversation for the generation service.

Every rule that does not need the model runs here, in this API's parameter
names, before anything is submitted: what musegl cannot honour is a 400
naming the parameter (``background``, ``conversation``, ``prompt``, a
``text.verbosity`` other than ``medium``, a reasoning effort the template has
no strength for, a ``concise`` summary, unknown ``include`` values, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs

from musegl_core.chat.messages import Message
from musegl_core.chat.template import TemplateVariables
from musegl_core.errors import ApiError, bad_request, unsupported
from musegl_core.service.retention import granted, openai_name, openai_retention
from musegl_core.service.rules import cache_salt, sampling_params, session_id as explicit_session
from musegl_core.service.logprobs import MAX_TOP_LOGPROBS
from musegl_core.service.conversation import AnswerFormat, Conversation, Settings
from musegl_core.service.sessions import client_session, explicit_header_session, private_session_name

from musegl_responses.items import Reader
from musegl_responses.schemas import ResponseRequest
from musegl_responses.store import ResponseStore, StoredResponse
from musegl_responses.tools import ToolSet, parse_tools, tool_choice

ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"
INCLUDES = (ENCRYPTED, LOGPROBS, "message.input_image.image_url")
EFFORTS = ("low", "medium", "high")
SUMMARIES = ("auto", "detailed")
KEY_SOURCE = "codex"  # soft sessions named by a client key: codex:<key> (docs/sessions.md)
#: a stored chain's own soft session: responses:sha256-<digest of its first response id> (the id is
#: a capability: the session list must not show it)
CHAIN_SOURCE = "responses"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@attrs.frozen
class ResponsePlan:
    """A validated request: the conversation to run and what the response object echoes."""

    id: str
    created_at: int
    conversation: Conversation
    tools: ToolSet
    new_messages: tuple[Message, ...]  # this request's own input (the store keeps it for the chain)
    prior: StoredResponse | None  # the response ``previous_response_id`` continues
    input_items: list
    request: ResponseRequest
    store: bool
    summary: bool  # reasoning summaries asked for (summary parts carry the reasoning)
    encrypted: bool  # include reasoning.encrypted_content
    logprobs: bool
    session: str | None
    soft: bool

    def echo(self) -> dict[str, Any]:
        """The request fields every response object repeats."""
        r = self.request
        choice = r.tool_choice if r.tool_choice is not None else "auto"
        return {
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": (r.reasoning.summary or r.reasoning.generate_summary) if r.reasoning else None},
            "store": self.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": (r.text.format if r.text and r.text.format else {"type": "text"}),
                     "verbosity": "medium"},
            "tool_choice": choice,
            "tools": list(r.tools or []),
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": r.truncation or "disabled",
            "metadata": dict(r.metadata or {}),
            "prompt_cache_key": r.prompt_cache_key,
            # the residency granted, in OpenAI's words ("24h" asked on a server without a disk tier: "in_memory")
            "prompt_cache_retention": openai_name(self.conversation.settings.retention),
            "top_logprobs": r.top_logprobs,
        }


def _check_fixed(r: ResponseRequest) -> None:
    if r.background:
        raise unsupported("background", "background responses are not supported; send the request and wait, "
                                        "or stream it")
    if r.conversation is not None:
        raise unsupported("conversation", "the Conversations API is not served; use previous_response_id or send "
                                          "the history in 'input'")
    if r.prompt is not None:
        raise unsupported("prompt", "stored prompt templates are not served; send 'instructions' and 'input'")
    if r.stream_options is not None and r.stream_options.include_obfuscation:
        raise unsupported("stream_options.include_obfuscation", "stream obfuscation is not implemented")
    if r.text is not None and r.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "the model has no verbosity control; only 'medium' is accepted")
    if r.truncation not in (None, "disabled", "auto"):
        raise bad_request("'truncation' must be 'auto' or 'disabled'", param="truncation")
    if r.max_output_tokens is not None and r.max_output_tokens < 1:
        raise bad_request(f"'max_output_tokens' must be a positive integer, got {r.max_output_tokens}",
                          param="max_output_tokens")
    if r.max_tool_calls is not None and r.max_tool_calls < 1:
        raise bad_request("'max_tool_calls' must be a positive integer", param="max_tool_calls")
    if r.top_logprobs is not None and not 0 <= r.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if r.metadata is not None:
        if len(r.metadata) > 16:
            raise bad_request("'metadata' takes at most 16 pairs", param="metadata")
        for key, value in r.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise bad_request("'metadata' keys are at most 64 characters and values 512", param=f"metadata.{key}")
    for name in ("prompt_cache_key", "previous_response_id"):
        value = getattr(r, name)
        if value is not None and not value:
            raise bad_request(f"'{name}' must not be empty", param=name)


def _reasoning(r: ResponseRequest) -> tuple[str | None, bool]:
    options = r.reasoning
    if options is None:
        return None, False
    effort = options.effort
    if effort is not None and effort not in EFFORTS:
        raise unsupported("reasoning.effort", f"'reasoning.effort' must be one of {', '.join(EFFORTS)} (the model "
                                              f"always reasons, at one of these strengths); got {effort!r}")
    summary = options.summary
    if options.generate_summary is not None:
        if summary is not None and summary != options.generate_summary:
            raise bad_request("'reasoning.generate_summary' contradicts 'reasoning.summary'",
                              param="reasoning.generate_summary")
        summary = options.generate_summary
    if summary is not None and summary not in SUMMARIES:
        raise unsupported("reasoning.summary", "musegl has no summarizer: the summary is the reasoning itself, so "
                                               "'reasoning.summary' may be 'auto' or 'detailed', not 'concise'")
    return effort, summary is not None


def _answer(r: ResponseRequest) -> AnswerFormat | None:
    fmt = r.text.format if r.text is not None else None
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        extra = set(fmt) - {"type"}
        if extra:
            raise unsupported(f"text.format.{sorted(extra)[0]}", "a text format takes no other keys")
        return None
    if kind == "json_object":
        return AnswerFormat(True, "text.format")
    if kind == "json_schema":
        unknown = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if unknown:
            raise unsupported(f"text.format.{sorted(unknown)[0]}", f"unknown key {sorted(unknown)[0]!r} in text.format")
        schema = fmt.get("schema", True)
        if not isinstance(schema, (dict, bool)) or schema is False:
            raise bad_request("'text.format.schema' must be a JSON Schema object", param="text.format.schema")
        return AnswerFormat(schema, "text.format.schema")
    raise bad_request("'text.format.type' must be 'text', 'json_object' or 'json_schema'", param="text.format.type")


def _includes(r: ResponseRequest) -> set[str]:
    found = set()
    for index, value in enumerate(r.include or []):
        if value not in INCLUDES:
            raise unsupported(f"include[{index}]", f"include {value!r} is not available here; musegl offers "
                                                   f"{', '.join(INCLUDES)}")
        found.add(value)
    return found


def plan_response(
    request: ResponseRequest,
    *,
    headers: Any,
    store: ResponseStore,
    reader: Reader,
    max_sessions: int,
    disk_tier: bool = False,
) -> ResponsePlan:
    """Validate ``request`` into a :class:`ResponsePlan`; raises :class:`ApiError`."""
    _check_fixed(request)
    effort, summary = _reasoning(request)
    includes = _includes(request)
    answer = _answer(request)
    sampling = sampling_params(request)
    tools = parse_tools(request.tools)
    choice, tools = tool_choice(request.tool_choice, tools, request.parallel_tool_calls is not False)
    prior = None
    if request.previous_response_id is not None:
        prior = store.get(request.previous_response_id)
        if prior is None:
            raise ApiError(404, f"Previous response with id {request.previous_response_id!r} not found.",
                           "invalid_request_error", "previous_response_not_found", "previous_response_id")
    if request.input is None and prior is None:
        raise bad_request("'input' is required", param="input")
    new = reader.messages(request.input if request.input is not None else [])
    messages: list[Message] = []
    if request.instructions:
        messages.append(Message(role="system", content=request.instructions))
    if prior is not None:
        messages += list(prior.messages)
    messages += new
    if not any(m_.role != "system" for m_ in messages):
        raise bad_request("the conversation has no input", param="input")
    response_id = new_id("resp")
    keep = request.store is not False and store.enabled
    explicit = explicit_session(None, explicit_header_session(headers))
    if explicit is None and prior is not None and prior.session is not None:
        session, soft = prior.session, prior.soft  # the session that produced the previous response
    else:
        session, soft = client_session(explicit, [
            (KEY_SOURCE, request.prompt_cache_key),
            (KEY_SOURCE, headers.get("session-id")),
            (KEY_SOURCE, headers.get("thread-id")),
            ("opencode", headers.get("x-session-affinity")),
        ])
    if session is None and keep and max_sessions > 0:
        session, soft = private_session_name(CHAIN_SOURCE, response_id), True  # a chain's first stored turn
    settings = Settings(
        max_tokens=request.max_output_tokens,
        sampling=sampling,
        session_id=session,
        soft_session=soft,
        stream=bool(request.stream),
        logprobs=(request.top_logprobs or 0) if (LOGPROBS in includes or request.top_logprobs is not None) else -1,
        cache_salt=cache_salt(request.cache_salt),
        retention=granted(openai_retention(request.prompt_cache_retention), disk_tier),
    )
    variables = TemplateVariables(reasoning_strength=effort, tool_namespace_descriptions=tools.namespace_descriptions)
    conversation = Conversation(messages=messages, settings=settings, tools=tools.defs, tool_choice=choice,
                                variables=variables, answer=answer)
    return ResponsePlan(
        id=response_id, created_at=int(time.time()), conversation=conversation, tools=tools,
        new_messages=tuple(new), prior=prior, input_items=input_items(request.input), request=request,
        store=keep, summary=summary, encrypted=ENCRYPTED in includes, logprobs=settings.logprobs >= 0,
        session=session, soft=soft,
    )


def input_items(raw: Any) -> list[dict[str, Any]]:
    """The input as ``input_items`` lists it: items with ids (a string input is one user message)."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]}]
    items = []
    for item in raw or []:
        if not isinstance(item, dict):
            continue
        item = dict(item)
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", new_id("msg" if item["type"] == "message" else "item"))
        items.append(item)
    return items


"""The ``/v1/models`` entry in OpenRouter's model shape.

OpenRouter describes a model with ``context_length``, ``architecture``,
``top_provider``, ``pricing`` and ``supported_parameters``. musegl's entry
adds those to the OpenAI fields (``object``, ``owned_by``, ``max_model_len``),
so OpenAI-only clients still read it. Every context number is the runtime
``--max-context`` budget, not the checkpoint's native window: OpenRouter-style
clients size their prompts from it, and the server does no compaction for them.

``supported_parameters`` is derived from the request schema the server parses
(:class:`~musegl_core.openai.schemas.ChatCompletionRequest`): every field but the
request's content and plumbing (:data:`NOT_PARAMETERS`), the tool fields only
when a tool parser is configured, plus OpenRouter's ``structured_outputs``
capability (``response_format`` json_schema is enforced). A field added to the
schema is therefore listed without anyone remembering to; the tests send every
listed parameter to a real server.
"""

from __future__ import annotations

import attrs

from musegl_core.http.dialect import ServedModel
from musegl_core.http.schemas import ModelEntry, omittable
from musegl_core.openai.schemas import ChatCompletionRequest

#: Request fields that are not generation parameters: the conversation, the
#: model name, the transport (streaming), musegl's session and cache plumbing,
#: template variables, and the two fields accepted only at their default.
NOT_PARAMETERS = frozenset({
    "messages", "model", "stream", "stream_options", "session_id", "prompt_cache_key", "cache_salt",
    "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message",
})
#: Accepted only when a tool parser is configured (``--tool-parser``).
TOOL_PARAMETERS = ("tools", "tool_choice", "parallel_tool_calls")
#: OpenRouter capability names that are not request fields, with the fields that provide them.
CAPABILITIES = {"structured_outputs": "response_format"}


def supported_parameters(tool_calling: bool) -> tuple[str, ...]:
    """The generation parameters this server honours, in schema order, then capabilities."""
    fields = [field.name for field in attrs.fields(ChatCompletionRequest) if field.name not in NOT_PARAMETERS]
    if not tool_calling:
        fields = [name for name in fields if name not in TOOL_PARAMETERS]
    return tuple(fields) + tuple(name for name, field in CAPABILITIES.items() if field in fields)


@attrs.frozen
class Architecture:
    """What goes in and out: text, plus one inline image when the model was
    loaded with its vision projector."""

    modality: str = "text->text"
    input_modalities: tuple[str, ...] = ("text",)
    output_modalities: tuple[str, ...] = ("text",)
    tokenizer: str = "Muse"
    instruct_type: str | None = None

    @classmethod
    def of(cls, model: ServedModel) -> Architecture:
        inputs = model.input_modalities
        return cls(modality="+".join(inputs) + "->text", input_modalities=inputs)


@attrs.frozen
class TopProvider:
    """The serving limits: the context budget and the longest possible completion
    (the budget less the one-position prompt floor, the BOS)."""

    context_length: int
    max_completion_tokens: int
    is_moderated: bool = False


@attrs.frozen
class Pricing:
    """musegl does not bill: every price is zero (OpenRouter writes prices as strings)."""

    prompt: str = "0"
    completion: str = "0"
    request: str = "0"
    image: str = "0"


@attrs.frozen
class OpenRouterModel:
    """One ``/v1/models`` entry readable by both OpenRouter and OpenAI clients."""

    id: str
    name: str
    created: int
    description: str
    context_length: int
    max_model_len: int
    architecture: Architecture
    top_provider: TopProvider
    pricing: Pricing
    supported_parameters: tuple[str, ...]
    per_request_limits: None = None
    object: str = "model"
    owned_by: str = "musegl"
    type: str = "model"  # Anthropic's model object: type, display_name, created_at
    display_name: str | None = omittable()
    created_at: str | None = omittable()
    demo: bool | None = omittable()

    @classmethod
    def describe(cls, model: ServedModel, openai_entry: ModelEntry) -> OpenRouterModel:
        """The entry for ``model``; ``openai_entry`` is the core's own entry, whose
        demo marking and description are kept."""
        description = openai_entry.description or (
            f"Muse Glimmer served by musegl ({model.backend or 'unknown'} backend)"
        )
        parameters = supported_parameters(model.tool_calling)
        return cls(
            id=model.name,
            name=model.name,
            created=model.created,
            description=description,
            context_length=model.context_length,
            max_model_len=model.context_length,
            architecture=Architecture.of(model),
            top_provider=TopProvider(model.context_length, max(model.context_length - 1, 1)),
            pricing=Pricing(),
            supported_parameters=parameters,
            display_name=openai_entry.display_name,
            created_at=openai_entry.created_at,
            demo=openai_entry.demo,
        )

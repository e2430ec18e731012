"""The ``/v1/models`` entry in OpenRouter's model shape.

OpenRouter describes a model with ``context_length``, ``architecture``,
``top_provider``, ``pricing`` and ``supported_parameters``. musegl's entry
adds those to the OpenAI fields (``object``, ``owned_by``, ``max_model_len``),
so OpenAI-only clients still read it. Every context number is the runtime
``--max-context`` budget, not the checkpoint's native window: OpenRouter-style
clients size their prompts from it, and the server does no compaction for them.
"""

from __future__ import annotations

import attrs

from musegl_core.http.dialect import ServedModel
from musegl_core.http.schemas import ModelEntry, omittable

#: Request parameters every musegl server honours.
SUPPORTED_PARAMETERS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "reasoning",
    "include_reasoning",
)
#: Added when a tool parser is configured (``--tool-parser``).
TOOL_PARAMETERS = ("tools", "tool_choice")


@attrs.frozen
class Architecture:
    """What goes in and out: Muse Glimmer reads text and one inline image."""

    modality: str = "text+image->text"
    input_modalities: tuple[str, ...] = ("text", "image")
    output_modalities: tuple[str, ...] = ("text",)
    tokenizer: str = "Muse"
    instruct_type: str | None = None


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
    demo: bool | None = omittable()

    @classmethod
    def describe(cls, model: ServedModel, openai_entry: ModelEntry) -> OpenRouterModel:
        """The entry for ``model``; ``openai_entry`` is the core's own entry, whose
        demo marking and description are kept."""
        description = openai_entry.description or (
            f"Muse Glimmer served by musegl ({model.backend or 'unknown'} backend)"
        )
        parameters = SUPPORTED_PARAMETERS + (TOOL_PARAMETERS if model.tool_calling else ())
        return cls(
            id=model.name,
            name=model.name,
            created=model.created,
            description=description,
            context_length=model.context_length,
            max_model_len=model.context_length,
            architecture=Architecture(),
            top_provider=TopProvider(model.context_length, max(model.context_length - 1, 1)),
            pricing=Pricing(),
            supported_parameters=parameters,
            demo=openai_entry.demo,
        )

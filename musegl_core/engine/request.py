"""A request as the engine sees it: what arrives, how it is prepared, how it runs.

* :class:`PromptSegment` and :class:`GenerateRequest` are what the front sends
  (a rendered prompt in segments, limits and sampling);
* :class:`PreparedRequest` is the same request after the worker's control
  thread prepared it once (tokenized, images preprocessed, seed fixed);
  both carry the fields of :class:`RequestOptions`;
* :class:`SequenceState` is the engine's running state of one request.

The events a request produces are in :mod:`musegl_core.engine.events`;
:mod:`musegl_core.worker.messages` only frames these types on the wire.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence

import attrs

from musegl_core.engine.executor import PromptImage, SamplingParams
from musegl_core.prompt import PromptSegment  # noqa: F401 (the request's prompt pieces; chat templates write them)


@attrs.frozen
class ImageInput:
    """An inline image as the client sent it: its media type (``image/png`` or
    ``image/jpeg``), its base64 text (the data URL's payload) and its ``detail``
    (``auto``, ``low``, ``high``; None: absent). The worker decodes and
    preprocesses it (:mod:`musegl_core.vision.preprocess`), ``detail`` choosing
    its patch budget."""

    media_type: str
    data: str = attrs.field(repr=lambda data: f"<{len(data)} base64 chars>")
    detail: str | None = None


@attrs.frozen
class LazyGrammar:
    """An output constraint that starts when the model opens a tool call
    (``tool_choice`` ``"auto"`` with ``strict: true`` tools,
    ``docs/constrained.md``): free output until then, and free again after the
    call. Both grammars are llguidance Lark
    (:func:`musegl_core.constrain.grammar.lazy_grammars`).

    ``in_tool_message`` applies from the first body token of a message whose
    header names a tool recipient (`` to=NAME<|message|>``, NAME neither
    ``self`` nor ``user``); ``in_visible_message`` from the token where
    ``trigger`` begins at a line start of a visible message's body, its lead
    rule absorbing the text of that token before the trigger."""

    trigger: str
    in_tool_message: str
    in_visible_message: str


@attrs.frozen
class RequestOptions:
    """What a generation request asks for, the same as the front sends it and
    once the worker prepared it: :class:`GenerateRequest` and
    :class:`PreparedRequest` both carry these fields."""

    id: str
    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()  # request stops (win over template stops)
    template_stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str | None = None
    add_bos: bool = True  # False: the prompt is used exactly as given (musegl generate)
    stream: bool = False  # a streamed request confirms a new session on its first output
    logprobs: int = -1  # top alternatives per generated token (-1: no logprobs)
    #: ``cache_salt``: KV is reused only from requests with the same salt (None: the unsalted space)
    cache_salt: str | None = None
    #: ``session_id`` names a soft session (a client's own conversation key): it idles out after
    #: ``--soft-session-idle-timeout``, is evicted first when slots run short, and a request that
    #: cannot have it (busy, no slot, another conversation holds it) runs anonymously instead
    soft_session: bool = False
    #: ``max_tokens`` only caps the answer (Anthropic's meaning): the prompt need not
    #: leave room for it, one position is reserved, and generation ends when the
    #: context is full (``Done.finish_reason`` ``length`` below ``max_tokens``)
    clamp_to_context: bool = False
    #: ids that end generation when drawn (vLLM's ``stop_token_ids``; their text is not emitted)
    stop_token_ids: tuple[int, ...] = ()
    #: before this many generated ids, end ids and ``stop_token_ids`` are masked and stop strings not applied
    min_tokens: int = 0
    #: which special tokens the output text writes out (vLLM's ``skip_special_tokens``): ``all``;
    #: ``control`` (only the output grammar's control tokens, which the channel parser reads:
    #: :data:`musegl_core.chat.channels.CONTROL_TOKENS`); ``none``
    special_tokens: str = attrs.field(default="all", validator=attrs.validators.in_(("all", "control", "none")))
    #: who sent it, for a fair share of admission (the front's peer address; None: one shared key):
    #: queued requests start round-robin over these keys, oldest first within a key
    client: str | None = None
    #: the response whose ``n`` choices this request is one of (choice 0's id; None: ``n`` = 1): an
    #: anonymous choice never waits for a slot that only its own group's choices would free
    group: str | None = None
    #: the residency the client asked for and was granted (engine/retention.py: "5m", "1h", "24h"; None: the
    #: server's defaults): how long its idle session is kept, and whether its blocks are written to disk
    retention: str | None = attrs.field(default=None, validator=attrs.validators.in_((None, "5m", "1h", "24h")))

    @property
    def completion_reservation(self) -> int:
        """Positions the prompt must leave free: ``max_tokens`` (1 when absent or clamped)."""
        return 1 if self.clamp_to_context else (self.max_tokens or 1)


@attrs.frozen
class GenerateRequest(RequestOptions):
    """A generation request as the front sends it to the worker: the prompt
    in segments, its images and its output constraint, with the options."""

    prompt: tuple[PromptSegment, ...] = attrs.field(kw_only=True)
    #: an output constraint (llguidance Lark grammar of the whole raw output,
    #: :mod:`musegl_core.constrain.grammar`), compiled by the worker's ``prepare``
    grammar: str | None = None
    #: a constraint activated when a tool call opens (exclusive with ``grammar``)
    lazy_grammar: LazyGrammar | None = None
    #: the images of the prompt, in order: the i-th fills the i-th ``<|patch|>`` placeholder
    images: tuple[ImageInput, ...] = ()


class LogitsProcessor(Protocol):
    """A per-sequence constraint on the next token (a grammar, a forced call).

    Called on the engine thread before every step that samples for the
    sequence, once per sampled row: ``generated`` is the sequence's generated
    ids so far (for a verified draft block, followed by the drafts before that
    row). Returns an allowed-token bitmask (numpy uint32, ``ceil(vocab/32)``
    words, bit ``i % 32`` of word ``i // 32`` allows id ``i``) or None when any
    token is allowed. The executor applies the masks of all rows batched.
    Keep it fast: it runs between steps.
    """

    def mask(self, generated: Sequence[int]) -> Any: ...

    # Optional members the engine reads when present: ``failure`` (a string
    # once the processor can no longer enforce its constraint: the engine
    # fails the request) and ``idle(generated_count)`` (True once no mask will
    # come again: the request's steps may then be launched ahead).


@attrs.frozen
class PlacedImage:
    """An image of a prompt: its rows are ``prompt_ids[start : start + image.rows]``."""

    start: int
    image: PromptImage


@attrs.frozen
class PreparedRequest(RequestOptions):
    """A request prepared once on the worker's control thread, ready for the engine.

    ``prompt_ids`` holds the placeholder id on image rows; ``images`` says
    where each image sits. ``sampling.seed`` is always set (a random one when
    the client gave none), so every draw is keyed by (seed, position).
    """

    prompt_ids: tuple[int, ...] = attrs.field(kw_only=True)
    images: tuple[PlacedImage, ...] = ()
    processors: tuple[Any, ...] = ()  # LogitsProcessor objects
    replay: Any = None  # a ReplayPlan computed on the control thread (engine.plan_replay)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=frozenset)  # looked up per drawn id

    @classmethod
    def of(cls, request: RequestOptions, **prepared: Any) -> PreparedRequest:
        """``request``'s options with what preparing it found (``prompt_ids``, a fixed ``sampling``, ...)."""
        options = {field.name: getattr(request, field.name) for field in attrs.fields(RequestOptions)}
        return cls(**{**options, **prepared})


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@attrs.define(eq=False)
class SequenceState:
    """Engine state of one running request.

    ``tokens`` is the prompt followed by the generated ids, as the executor
    is fed (image rows hold their placeholder id); ``keys`` is the same list
    with image rows replaced by identities derived from the image's digest,
    which is what sessions compare for prefix reuse. ``computed`` counts the
    positions whose K/V are in the cache. In decode, the last token is the
    one not yet computed: each step feeds it (plus any drafts) and samples.
    """

    request: PreparedRequest
    handle: int
    max_new: int
    tokens: list[int]
    session: object  # musegl_core.engine.sessions.Session: owns the slot and its blocks
    keys: list[int] = None  # type: ignore[assignment]  # default: a copy of ``tokens`` (no images)
    prompt_len: int = 0  # the executed prompt (after generated-token replay)
    computed: int = 0
    cached: int = 0
    #: a rewind past the sliding layers' window (docs/engine.md "Rewinds past the window"): the
    #: positions before this hold their full layers' K/V; from ``computed`` up to it only the
    #: sliding layers' are recomputed
    rewound: int = 0
    generated: list[int] = attrs.field(factory=list)
    chars: list[int] = attrs.field(factory=list)  # characters each generated id added to the text
    unreported: list[int] = attrs.field(factory=list)  # ids whose text is still held back
    unreported_logprobs: list = attrs.field(factory=list)
    phase: Phase = Phase.PREFILL
    decode_turns: int = 0
    drafts: list[int] = attrs.field(factory=list)  # proposed for the next step
    drafted: int = 0  # drafts proposed and accepted over the request (speculative decoding)
    accepted: int = 0
    embeddings: dict[int, Any] = attrs.field(factory=dict)  # image start -> computed rows
    detokenizer: object = None
    stops: object = None

    def __attrs_post_init__(self) -> None:
        if self.keys is None:
            self.keys = list(self.tokens)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def blocks(self) -> list[int]:
        return self.session.slot.blocks

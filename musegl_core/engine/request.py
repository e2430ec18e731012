"""A request as the engine runs it, and the events it produces."""

from __future__ import annotations

import enum
from typing import Sequence

import attrs

from musegl_core.engine.executor import SamplingParams


@attrs.frozen
class PreparedRequest:
    """A tokenized request, ready for the scheduler (prepared on the control thread)."""

    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    template_stops: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str | None = None
    add_bos: bool = True
    stream: bool = False


class Phase(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@attrs.define(eq=False)
class SequenceState:
    """Engine state of one running request.

    ``tokens`` is the prompt followed by the generated ids; ``computed`` counts
    the positions whose K/V are in the cache. In decode, the last token is the
    one not yet computed: each step feeds it and samples the next.
    """

    request: PreparedRequest
    handle: int
    max_new: int
    tokens: list[int]
    session: object  # musegl_core.engine.sessions.Session: owns the slot and its blocks
    prompt_len: int = 0  # the executed prompt (after generated-token replay)
    computed: int = 0
    cached: int = 0
    generated: list[int] = attrs.field(factory=list)
    unreported: list[int] = attrs.field(factory=list)  # ids whose text is still held back
    phase: Phase = Phase.PREFILL
    started: bool = False
    cancelled: bool = False
    decode_turns: int = 0
    detokenizer: object = None
    stops: object = None

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def blocks(self) -> list[int]:
        return self.session.slot.blocks


    def pending(self) -> Sequence[int]:
        return self.tokens[self.computed :]

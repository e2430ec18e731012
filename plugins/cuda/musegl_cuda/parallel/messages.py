"""What the engine's process and the ranks say to each other over the :class:`~.channel.StepChannel`.

Every rank reads every request (in order); only rank 0 answers, with a
:class:`Reply` carrying the request's ``number``. Requests without a number
(:class:`CopyBlocks`) get no answer: the next request's answer follows them.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from musegl_core.engine.executor import ExecutorLimits, ModelInfo, PromptImage, Step


@attrs.frozen
class Loaded:
    """Rank 0's first answer (number 0), once every rank holds its weights."""

    info: ModelInfo
    limits: ExecutorLimits
    block_size: int
    kv_bytes_per_block: list[int]  # per rank
    free_memory: list[int | None]  # per rank: device memory free after the weights (CUDA), else None
    weight_bytes: dict[str, int]  # summed over the ranks
    pids: list[int]


@attrs.frozen
class ExpectTaps:
    """A speculator's taps, before :class:`AllocateKV` (the decode graphs are captured with them)."""

    number: int
    taps: tuple[int, ...]


@attrs.frozen
class AllocateKV:
    number: int
    num_blocks: int


@attrs.frozen
class RunStep:
    number: int
    step: Step


@attrs.frozen
class CopyBlocks:
    pairs: Sequence[tuple[int, int]]


@attrs.frozen
class EmbedImage:
    """Rank 0 runs the (replicated) vision tower; the rows come back to the engine."""

    number: int
    image: PromptImage


@attrs.frozen
class EmbeddingRows:
    """TargetAccess: raw embedding rows of ``ids`` (every rank takes part: the rows are split)."""

    number: int
    ids: Any


@attrs.frozen
class HeadLogits:
    """TargetAccess: the raw head product of ``hidden`` (every rank takes part)."""

    number: int
    hidden: Any


@attrs.frozen
class Shutdown:
    pass


@attrs.frozen
class Reply:
    """Rank 0's answer to request ``number``: ``value``, or ``error`` (the exception, rebuilt
    by the engine's side as the same type where it can)."""

    number: int
    value: Any = None
    error: BaseException | None = None

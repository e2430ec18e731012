"""The executor contract: what the engine asks of a model backend.

The engine never touches tensors. It hands the executor a :class:`Step`, a
packed list of :class:`SeqChunk` objects, and gets back a :class:`StepOutput`.
The KV cache is *off-graph and paged*: the engine's :class:`~musegl_core.engine.kv_pool.KVPool`
decides which block ids a sequence owns; the executor only stores and reads
the K/V tensors those ids index. ``docs/executor.md`` explains why the contract
has this shape (CUDA graphs, DFlash verification, MLX).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import attrs


@attrs.frozen
class SamplingParams:
    """Per-sequence sampling, applied inside the executor.

    ``temperature == 0`` means greedy (argmax, lowest index wins ties).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. ``seed`` makes the
    sequence's draws reproducible whatever else is in the batch: the executor
    keeps one random generator per sequence, seeded from it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class ModelInfo:
    """What the engine and the front need to know about a loaded model."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    native_context: int
    dtype: str
    backend: str
    demo: bool = False


@attrs.define
class SeqChunk:
    """One sequence's rows in a packed step.

    ``positions[i]`` is the absolute position of ``tokens[i]``; positions of
    one chunk are consecutive. ``blocks`` is the sequence's block table: block
    ``blocks[p // block_size]`` holds the K/V of position ``p`` for every
    position the chunk reads (``0 .. positions[-1]``) or writes.

    ``sample`` asks for one sampled token after the chunk's last row (the end
    of a prefill, or a decode step). ``want_logits`` asks for the float32
    logits of the last row as well (``generate --json --logits``, tests,
    speculative verification). ``logit_rows`` asks for the logits of every row
    of the chunk (DFlash block verification, parity tests).
    """

    seq: int
    tokens: Sequence[int]
    positions: Sequence[int]
    blocks: Sequence[int]
    sample: bool = False
    sampling: SamplingParams = GREEDY
    want_logits: bool = False
    logit_rows: bool = False

    def __attrs_post_init__(self) -> None:
        if len(self.tokens) != len(self.positions) or not self.tokens:
            raise ValueError("a chunk needs one position per token and at least one token")


@attrs.define
class Step:
    """A packed forward over several sequences.

    ``taps`` names decoder layers whose *input* residual (the output of the
    previous layer, GGUF convention) is returned for every row, for drafts
    such as DFlash. An empty tuple means no taps.
    """

    chunks: list[SeqChunk]
    taps: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


@attrs.define
class StepOutput:
    """What a step returns, keyed by sequence handle.

    ``tokens`` has an entry for every chunk with ``sample``; ``logits`` for
    every chunk with ``want_logits`` (shape ``(vocab,)``) or ``logit_rows``
    (shape ``(rows, vocab)``); ``hidden`` maps a sequence to an array of shape
    ``(len(taps), rows, hidden)``. Arrays are backend-native (torch, mlx) or
    numpy; the engine only passes them through.
    """

    tokens: dict[int, int] = attrs.field(factory=dict)
    logits: dict[int, Any] = attrs.field(factory=dict)
    hidden: dict[int, Any] = attrs.field(factory=dict)


@attrs.frozen
class ExecutorLimits:
    """Shape limits an executor announces so the scheduler packs steps it can run.

    ``step_sizes`` lists fixed step widths (in tokens) the backend has
    precompiled (CUDA graphs); an empty tuple means any width. The scheduler
    never exceeds ``max_step_tokens`` per step.
    """

    max_step_tokens: int = 4096
    step_sizes: tuple[int, ...] = ()


@runtime_checkable
class Executor(Protocol):
    """A model backend. Created by an executor plugin's factory in the worker.

    Lifecycle: the worker creates the executor (weights load, with progress),
    reads :attr:`info`, asks :meth:`kv_bytes_per_block` to size the pool, then
    calls :meth:`allocate_kv` once. After that only :meth:`step` and
    :meth:`copy_blocks` are called, from one engine thread.
    """

    info: ModelInfo
    block_size: int
    limits: ExecutorLimits

    def kv_bytes_per_block(self) -> int:
        """Bytes one KV block costs across all layers (K and V)."""

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the paged KV storage for ``num_blocks`` blocks."""

    def step(self, step: Step) -> StepOutput:
        """Run one packed forward, write K/V into the chunks' blocks, sample."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the K/V contents of block ``src`` into block ``dst`` for each pair
        (copy-on-write when a shared prefix block is about to be written)."""

    def release_sequence(self, seq: int) -> None:
        """Forget per-sequence state (the sampling generator). Blocks are not
        touched: the engine owns block lifetime."""

    def close(self) -> None:
        """Free device memory. The executor is not used afterwards."""

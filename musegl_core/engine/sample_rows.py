"""The host side of an executor's batched sampler (docs/executor.md section 5).

An executor samples every sampled row of a step in one batched chain on its
device; what that chain needs from the step is backend-neutral and lives
here, in numpy and pure Python:

* :class:`SampleRows`: the sampled rows of a step in order, with each row's
  :class:`~musegl_core.engine.executor.SamplingParams`, uniform number,
  allowed-token mask, penalty ids and log-probability request;
* :func:`unpack_mask` / :func:`unpack_masks`: packed ``uint32`` bitmasks (bit
  ``i % 32`` of word ``i // 32``) as boolean allow-vectors;
* :func:`penalty_counts`: per penalized row, which ids were seen (prompt
  included) and how often each was generated;
* :func:`bias_entries`: the ``logit_bias`` of every row as (row, id, value)
  columns, ids outside the vocabulary dropped.

The executor keeps only its device chain: moving these arrays to the device
and the batched operations on the logits.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import SamplingParams, SeqChunk


@attrs.define
class SampleRows:
    """The sampled rows of a step, in order, with what each needs."""

    params: list[SamplingParams] = attrs.field(factory=list)
    uniforms: list[float] = attrs.field(factory=list)
    masks: list[np.ndarray | None] = attrs.field(factory=list)
    counted: list[tuple[Sequence[int], int]] = attrs.field(factory=list)  # (ids, prompt part) for penalties
    logprobs: list[int] = attrs.field(factory=list)

    @classmethod
    def of(cls, step) -> "SampleRows":
        """Every sampled row of every chunk of ``step`` (read the masks after the forward:
        :class:`~musegl_core.engine.masks.PendingMasks` waits for them)."""
        rows = cls()
        for chunk in step.chunks:
            rows.add_chunk(chunk)
        return rows

    def add_chunk(self, chunk: SeqChunk) -> None:
        params = chunk.sampling
        for j, row in enumerate(chunk.sampled_rows):
            self.params.append(params)
            self.uniforms.append(chunk.uniforms[j] if j < len(chunk.uniforms) else 0.5)
            self.masks.append(chunk.masks[j] if j < len(chunk.masks) else None)
            if params.penalized:
                self.counted.append((list(chunk.history) + list(chunk.tokens[: row + 1]), chunk.prompt_len))
            else:
                self.counted.append(((), 0))
            self.logprobs.append(chunk.logprobs)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def processed(self) -> bool:
        """Some row has a logit bias, a penalty or a mask (step 1 of the rule has work)."""
        return any(p.logit_bias or p.penalized for p in self.params) or any(m is not None for m in self.masks)

    @property
    def penalized(self) -> list[int]:
        """The rows a penalty applies to."""
        return [i for i, p in enumerate(self.params) if p.penalized]

    @property
    def wanted(self) -> list[int]:
        """The rows that asked for log-probabilities."""
        return [i for i, n in enumerate(self.logprobs) if n >= 0]


def unpack_mask(mask: Any, vocab_size: int) -> np.ndarray:
    """The boolean allow-vector ``(vocab,)`` of one packed uint32 bitmask."""
    bits = np.unpackbits(np.asarray(mask, dtype=np.uint32).view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def unpack_masks(masks: Sequence[Any], vocab_size: int) -> np.ndarray | None:
    """``(rows, vocab)`` bool of allowed ids (every id allowed in a row without a mask),
    or None when no row has a mask."""
    if all(m is None for m in masks):
        return None
    words = -(-vocab_size // 32)
    packed = np.full((len(masks), words), 0xFFFFFFFF, dtype=np.uint32)
    for i, m in enumerate(masks):
        if m is not None:
            packed[i] = np.asarray(m, dtype=np.uint32)[:words]
    bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return bits.astype(bool)


def penalty_counts(rows: SampleRows, index: Sequence[int], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For the penalized rows ``index``: ``seen`` (bool, every counted id, prompt
    included) and ``generated`` (float32, occurrences after the prompt), each
    ``(len(index), vocab)``; ids outside the vocabulary are not counted."""
    seen = np.zeros((len(index), vocab_size), dtype=np.bool_)
    generated = np.zeros((len(index), vocab_size), dtype=np.float32)
    for k, i in enumerate(index):
        ids, prompt_len = rows.counted[i]
        all_ids = np.asarray(list(ids), dtype=np.int64)
        seen[k, all_ids[(all_ids >= 0) & (all_ids < vocab_size)]] = True
        gen = all_ids[prompt_len:]
        np.add.at(generated[k], gen[(gen >= 0) & (gen < vocab_size)], 1.0)
    return seen, generated


def bias_entries(rows: SampleRows, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every row's ``logit_bias`` as three columns (row ``int64``, id ``int64``, value
    ``float32``) to add, ids outside the vocabulary dropped; None when there is none."""
    entries = [(i, t, x) for i, p in enumerate(rows.params) for t, x in p.logit_bias if 0 <= t < vocab_size]
    if not entries:
        return None
    r, c, v = zip(*entries)
    return np.asarray(r, dtype=np.int64), np.asarray(c, dtype=np.int64), np.asarray(v, dtype=np.float32)

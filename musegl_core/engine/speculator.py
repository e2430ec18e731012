"""Speculative decoding: the contract a drafter (DFlash, n-gram lookup, ...) implements.

A speculator proposes up to ``k`` draft tokens for a decoding sequence. The
engine then sends the sequence's pending token followed by the drafts as one
chunk with ``sample = k + 1``: the executor samples the target's token after
every row with the request's own sampling (bias, penalties, masks,
temperature, top-k/p, min-p) and the row's position-keyed random number.
The engine keeps the target's tokens while the drafts agree with them:

    rows:     pending   d1   d2   d3
    sampled:  s0        s1   s2   s3
    accepted: s0, then s1 if d1 == s0, then s2 if d2 == s1, ...

so the committed tokens are exactly the tokens the target alone would have
produced at those positions (same seed, same positions, same numbers): the
output is identical with or without a speculator, for greedy and seeded
sampling alike, and only the speed changes. Rows past the first disagreement
wrote K/V that the engine simply forgets (the sequence's length rolls back;
later steps overwrite those cache cells).

A speculator that keeps state per position (a draft model's own cache) keeps
it in the engine's block ids, like the executor: :meth:`Speculator.copy_blocks`
follows copy-on-write, and :meth:`Speculator.observe` sees every step with
the hidden states it asked for (``taps``), so sessions, snapshots, rewinds and
cancellation need nothing special.

Drafts may also stay on the device (:class:`DeviceDrafts`), where both the
speculator's class defines ``propose_on_device`` and the executor announces
``limits.device_drafts``: the engine then sends placeholder draft rows that
name their row of the drafts (``SeqChunk.draft_row``), and the executor reads
the draft ids there, compares them with its sampled ids and returns how many
agree (``StepOutput.accepted``), so a step needs one wait for the device
instead of one for the drafts and one for the step. The engine does this only
for steps whose decoding sequences need nothing the host computes from the
drafts (grammar masks, penalties); the committed tokens are the same.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import attrs

from musegl_core.engine.executor import Step, StepOutput


@attrs.frozen
class DraftRequest:
    """One decoding sequence the engine asks drafts for.

    ``tokens`` is the sequence so far (prompt and generated ids; image rows
    hold their placeholder id); its last id is the pending token, whose K/V
    is not yet computed and which sits at position ``len(tokens) - 1``.
    ``blocks`` is the block table (covering the pending token's block).
    ``max_draft`` bounds the drafts (remaining ``max_tokens`` and context).
    """

    seq: int
    tokens: Sequence[int]
    blocks: Sequence[int]
    max_draft: int


@attrs.frozen
class DeviceDrafts:
    """Drafts left on the device: ``ids`` is a backend array ``(rows, k)``; sequence
    ``seq``'s drafts are the first ``counts[seq]`` ids of row ``rows[seq]``."""

    ids: Any
    rows: dict[int, int]
    counts: dict[int, int]


def proposes_on_device(speculator: object) -> bool:
    """Does the speculator's class define ``propose_on_device(requests) -> DeviceDrafts``?
    (Looked up on the class: a wrapper that forwards other attributes to an inner
    speculator, and replaces its drafts, keeps the host path.)"""
    return callable(getattr(type(speculator), "propose_on_device", None))


@runtime_checkable
class Speculator(Protocol):
    """A drafter, created by a ``musegl_speculators`` plugin's factory in the worker.

    Lifecycle mirrors the executor's (the engine calls both from its thread):
    ``kv_bytes_per_block`` and ``allocate_kv`` when the pool is sized, then per
    step ``propose`` (before the step, for decoding sequences), ``observe``
    (after it), ``copy_blocks`` and ``release_sequence`` as the executor gets
    them, and ``close``.
    """

    #: Target layers whose input residual the speculator needs for every row of every step.
    taps: tuple[int, ...]
    #: The most drafts it proposes per sequence and step.
    max_draft: int

    def kv_bytes_per_block(self) -> int:
        """Bytes of the speculator's own per-block state (0 if none)."""

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate per-block state for ``num_blocks`` blocks."""

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        """Draft tokens per sequence handle (at most ``max_draft`` of each
        request; a missing or empty entry means "no drafts this step")."""

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        """After a step: ``output.hidden`` holds the tapped rows; ``committed[seq]``
        is how many leading rows of the sequence's chunk are now part of its
        history (all rows of a prefill chunk; ``accepted + 1`` of a verify chunk)."""

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Mirror the executor's copy-on-write."""

    def release_sequence(self, seq: int) -> None:
        """Forget per-sequence state."""

    def close(self) -> None:
        """Free memory."""


class NoSpeculator:
    """Proposes nothing: decoding is exactly as without a speculator."""

    taps: tuple[int, ...] = ()
    max_draft = 0

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate_kv(self, num_blocks: int) -> None:
        pass

    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        return {}

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        pass

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        pass

    def release_sequence(self, seq: int) -> None:
        pass

    def close(self) -> None:
        pass


def accept(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The committed tokens of a verified block: ``sampled[0]``, then
    ``sampled[i]`` while ``drafts[i-1] == sampled[i-1]``."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} sampled rows, got {len(sampled)}")
    committed = [sampled[0]]
    for draft, target in zip(drafts, sampled[1:]):
        if draft != committed[-1]:
            break
        committed.append(target)
    return committed

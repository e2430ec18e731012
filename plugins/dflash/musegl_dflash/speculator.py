"""``DFlashSpeculator``: the engine's speculator contract over the DFlash draft.

Per step the engine asks :meth:`propose` for drafts for its decoding
sequences; every sequence contributes one block ``[anchor, MASK × n]`` at
positions ``P .. P+n`` (``P = len(tokens) − 1``, the anchor being the pending
token) and all blocks run in **one** draft forward. The drafts are the argmax
of the target's raw lm_head over the final-normed mask rows (greedy), so the
engine's sample-and-match verification keeps the output exactly the target's
under any sampling settings.

The draft's context K/V live in the engine's KV block ids, like the target's:
:meth:`observe` receives the tapped target rows of every step (prefill chunks
and verify blocks) and writes the context K/V of the rows the engine kept
(``committed[seq]`` leading rows) at their positions; rejected rows never
enter the store. Copy-on-write (:meth:`copy_blocks`) mirrors the target's, so
sessions, prefix snapshots, rewinds and cancellation need nothing else: a
sequence's store holds exactly the positions its target KV holds.

On CUDA the draft forward replays a CUDA graph per padded shape
(:mod:`musegl_dflash.graphs`), and :meth:`propose_on_device` leaves the drafts
on the device for an executor that reads them there (``limits.device_drafts``):
the verify step takes its draft rows from them and compares them with its
sampled ids itself, so a step waits for the device once.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import attrs
import numpy as np
import torch

from musegl_core.engine.executor import Step, StepOutput
from musegl_core.engine.speculator import DeviceDrafts, DraftRequest
from musegl_core.engine.step_checks import coverage_error, kv_allocated
from musegl_dflash.graphs import BlockInputs, DraftGraphs, block_drafts
from musegl_dflash.model import DFlashDraft, linear

log = logging.getLogger("musegl.dflash")


def as_tensor(array: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A backend-native array (torch, numpy, anything ``np.asarray`` reads) as a tensor."""
    if not isinstance(array, torch.Tensor):
        array = torch.from_numpy(np.asarray(array, dtype=np.float32))
    return array.to(device, dtype)


@attrs.frozen
class KeptRows:
    """The rows of one step a draft's context store takes: every committed row's tapped
    features ``(n, taps × H)``, its position and its cache slot (``block × block_size +
    offset`` in the sequence's table), and how many verify blocks the step held and the
    tokens they committed (for the mean acceptance length)."""

    features: torch.Tensor
    positions: list[int]
    slots: list[int]
    verify_blocks: int
    verify_tokens: int


def block_drafts_for(requests: Sequence[DraftRequest], most: int) -> int:
    """Mask rows of this step's draft blocks: the most drafts a request may verify
    (``max_draft``, which the engine's verify-rows budget lowers as the batch grows),
    rounded up to a power of two, at most ``most``. A block of fewer mask rows costs
    less (the draft's layers and the head run over them) and its leading ids are what
    the verify step reads; verification decides every token either way."""
    want = max(r.max_draft for r in requests)
    return min(most, 1 << max(0, want - 1).bit_length())


def kept_rows(step: Step, output: StepOutput, committed: dict[int, int], block_size: int,
              device: torch.device, dtype: torch.dtype) -> KeptRows | None:
    """The ``committed[seq]`` leading tapped rows of each chunk of ``step`` (None when no
    chunk kept a row with hidden states); a row past the chunk's block table is an error."""
    features, positions, slots = [], [], []
    verify_blocks = verify_tokens = 0
    for chunk in step.chunks:
        kept = committed.get(chunk.seq, 0)
        hidden = output.hidden.get(chunk.seq)
        if kept <= 0 or hidden is None:
            continue
        if chunk.sample > 1:  # a verify block: ``sample - 1`` drafts
            verify_blocks += 1
            verify_tokens += kept
        rows = as_tensor(hidden, device, dtype)[:, :kept]  # (taps, kept, H)
        features.append(rows.permute(1, 0, 2).reshape(kept, -1))
        pos = list(chunk.positions[:kept])
        blocks = chunk.blocks
        if pos[-1] // block_size >= len(blocks):
            raise coverage_error(chunk.seq, pos[-1], block_size, len(blocks))
        positions.extend(pos)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
    if not features:
        return None
    return KeptRows(torch.cat(features), positions, slots, verify_blocks, verify_tokens)


@attrs.frozen
class TargetHead:
    """The target's raw token embedding rows and raw lm_head product, which the draft
    borrows (it has neither): ``rows(ids)`` gives ``ids.shape + (hidden,)`` (no
    embedding norm), ``logits(hidden)`` maps ``(n, hidden)`` to ``(n, vocab)`` (no softcap)."""

    rows: Callable[[torch.Tensor], torch.Tensor]
    logits: Callable[[torch.Tensor], torch.Tensor]
    #: optional: ``(n, hidden)`` to the head's argmax ids ``(n,)`` without the whole logits
    #: (a tensor-parallel rank's vocabulary-parallel argmax); None: the argmax of ``logits``
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of_tensors(cls, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> "TargetHead":
        """From the two ``(vocab, hidden)`` matrices (shared, not copied)."""
        return cls(embed_tokens.__getitem__, lambda hidden: linear(hidden, lm_head.to(hidden.dtype)))


class DFlashSpeculator:
    """Block drafting with a DFlash draft over a target executor (any backend)."""

    #: with the engine's sliding pages (``--sliding-window-kv``) the context store follows: it is
    #: indexed by the full layers' block ids (``SeqChunk.blocks``), which keep every position, and
    #: a window recomputation's rows are not observed again (the engine leaves them out of
    #: ``committed``); its store spans every page id (the engine sizes the pool for that)
    follows_sliding_pages = True

    #: how many trailing ids of a request's ``tokens`` it reads (the anchor; the rest only
    #: by their count): a host that sends the requests to another process sends only these
    token_tail = 1

    def __init__(self, draft: DFlashDraft, target: TargetHead, n_draft: int, block_size: int,
                 graphs: bool | None = None) -> None:
        """``graphs``: run the draft forward through :class:`DraftGraphs` (None: on CUDA;
        on the CPU they run their body eagerly, for tests)."""
        config = draft.config
        if not 1 <= n_draft < config.block_size:
            raise ValueError(f"n_draft must be in 1..{config.block_size - 1}")
        self.draft = draft
        self.config = config
        self.target = target
        self.block_size = block_size  # the engine's KV block size (positions per block)
        self.taps = config.taps
        self.max_draft = n_draft
        self.kv: torch.Tensor | None = None
        self.num_blocks = 0
        self.use_graphs = draft.device.type == "cuda" if graphs is None else graphs
        self.graphs: DraftGraphs | None = None
        # Counters for the log line and tests: verify blocks seen and the tokens they committed.
        self.blocks = 0
        self.committed_tokens = 0

    # -- per-block state ---------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        size = torch.empty((), dtype=self.draft.dtype).element_size()
        return self.block_size * self.config.kv_bytes_per_position(size)

    def allocate_kv(self, num_blocks: int) -> None:
        c = self.config
        self.kv = torch.zeros(c.num_layers, 2, num_blocks * self.block_size, c.num_kv_heads, c.head_dim,
                              dtype=self.draft.dtype, device=self.draft.device)
        self.num_blocks = num_blocks
        if self.use_graphs:
            self.graphs = DraftGraphs(self.draft, self.target.rows, self.target.logits, self.max_draft,
                                      self.block_size, self.target.argmax)

    def _require_kv(self) -> torch.Tensor:
        return kv_allocated(self.kv, "drafting")

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if not pairs:
            return
        kv = self._require_kv()
        c = self.config
        paged = kv.view(c.num_layers, 2, self.num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=kv.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv.device)
        with torch.inference_mode():
            paged[:, :, dst] = paged[:, :, src]

    def release_sequence(self, seq: int) -> None:
        pass  # no per-sequence state: the context lives in the sequence's blocks

    def close(self) -> None:
        self.kv = None
        self.graphs = None
        self.num_blocks = 0

    # -- drafting ----------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        found = self.propose_on_device(requests)
        drafts = found.ids.tolist()
        return {seq: drafts[row][:found.counts[seq]] for seq, row in found.rows.items()}

    def propose_on_device(self, requests: Sequence[DraftRequest]) -> DeviceDrafts:
        """:meth:`propose`, the drafts left on the device (queued, not waited for)."""
        kv = self._require_kv()
        requests = [r for r in requests if r.max_draft > 0 and r.tokens]
        if not requests:
            return DeviceDrafts(torch.zeros(0, self.max_draft, dtype=torch.long), {}, {})
        device = self.draft.device
        starts = [len(r.tokens) - 1 for r in requests]
        for r, start in zip(requests, starts):
            if start > 0 and (start - 1) // self.block_size >= len(r.blocks):
                raise coverage_error(r.seq, start - 1, self.block_size, len(r.blocks))
        anchors = [r.tokens[-1] for r in requests]
        tables = [r.blocks for r in requests]
        n = block_drafts_for(requests, self.max_draft)
        with torch.inference_mode():
            ids = None if self.graphs is None else self.graphs.run(anchors, starts, tables, kv, n)
            if ids is None:  # no graphs, or a shape past their limits
                batch = BlockInputs.exact(self.config, self.block_size, anchors, starts, tables, device)
                ids = block_drafts(self.draft, self.target.rows, self.target.logits, kv, batch, n,
                                   argmax=self.target.argmax)
        return DeviceDrafts(ids, {r.seq: b for b, r in enumerate(requests)},
                            {r.seq: min(r.max_draft, self.max_draft) for r in requests})

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        """Store the context K/V of every committed row of the step."""
        kv = self._require_kv()
        device = self.draft.device
        rows = kept_rows(step, output, committed, self.block_size, device, self.draft.dtype)
        if rows is None:
            return
        self.blocks += rows.verify_blocks
        self.committed_tokens += rows.verify_tokens
        with torch.inference_mode():
            at = torch.tensor([rows.positions, rows.slots], dtype=torch.long).to(device)  # one copy
            self.draft.write_context(rows.features, at[0], at[1], kv)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens committed per verify block (accepted drafts + the target's own token)."""
        return self.committed_tokens / self.blocks if self.blocks else 0.0

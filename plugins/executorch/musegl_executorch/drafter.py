"""``ProgramDrafter``: the engine's speculator contract over the draft methods of an
export made with ``musegl export MODEL --dflash DRAFT``.

It does what :class:`musegl_dflash.speculator.DFlashSpeculator` does with the
eager draft, through the program (``musegl_executorch/export/draft.py``):

* :meth:`observe` sends the tapped rows the engine kept (every row of a
  prefill chunk, ``accepted + 1`` rows of a verify block) through
  ``draft_context`` and writes the returned context K/V at the rows' cells of
  its own off-graph pool (``dk_pool``/``dv_pool``, indexed by the engine's
  block ids like the target's pool, so copy-on-write, sessions and rewinds
  need nothing else);
* :meth:`propose` runs every decoding sequence's block ``[anchor, MASK × n]``
  through ``draft_block``, up to the exported ``max_owners`` blocks per call;
  the program embeds the block with the target's table, runs the draft, and
  returns the greedy drafts (the argmax of the target's raw head).

``n`` (``--dflash-n-draft``) is any value from 1 to the block size minus one:
the block axis is dynamic, so it is chosen at serve time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

from musegl_core.engine.executor import Step, StepOutput
from musegl_core.engine.speculator import DraftRequest
from musegl_core.engine.step_checks import coverage_error, kv_allocated
from musegl_dflash.model import gather_context
from musegl_dflash.speculator import kept_rows
from musegl_executorch.pools import copy_pool_blocks
from musegl_executorch.export.lower import DRAFT_BLOCK, DRAFT_CONTEXT

if TYPE_CHECKING:
    from musegl_executorch.artifact import DFlashExport

NEG_INF = float("-inf")


class ProgramRunner(Protocol):
    """What the drafter needs of the executor: its exported program's methods
    (:class:`~musegl_executorch.executor.ExecuTorchExecutor` provides it)."""

    block_size: int
    dtype: torch.dtype
    manifest: Any  # ``limits.max_prefill_chunk``

    def execute(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


class ProgramDrafter:
    """DFlash block drafting through the exported program's draft methods."""

    def __init__(self, executor: ProgramRunner, export: "DFlashExport", n_draft: int) -> None:
        if not 1 <= n_draft < export.max_block:
            raise ValueError(f"n_draft must be in 1..{export.max_block - 1}")
        self.executor = executor
        self.export = export
        self.config = export.config
        self.block_size = executor.block_size
        self.taps = export.taps
        self.max_draft = n_draft
        self.dtype = executor.dtype
        self.dk_pool: torch.Tensor | None = None
        self.dv_pool: torch.Tensor | None = None
        self.num_blocks = 0
        self.blocks = 0  # verify blocks seen and the tokens they committed (as DFlashSpeculator counts)
        self.committed_tokens = 0

    # -- per-block state ---------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.block_size * self.config.kv_bytes_per_position(self.dtype.itemsize)

    def allocate_kv(self, num_blocks: int) -> None:
        c = self.config
        shape = (c.num_layers, max(num_blocks * self.block_size, 2), c.num_kv_heads, c.head_dim)
        self.dk_pool = torch.zeros(shape, dtype=self.dtype)
        self.dv_pool = torch.zeros(shape, dtype=self.dtype)
        self.num_blocks = num_blocks

    def _pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv_allocated(self.dv_pool, "drafting")
        return kv_allocated(self.dk_pool, "drafting"), self.dv_pool

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        copy_pool_blocks(self._pool(), pairs, self.block_size)

    def release_sequence(self, seq: int) -> None:
        pass  # no per-sequence state: the context lives in the sequence's blocks

    def close(self) -> None:
        self.dk_pool = self.dv_pool = None
        self.num_blocks = 0

    # -- drafting ----------------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> dict[int, list[int]]:
        dk, dv = self._pool()
        requests = [r for r in requests if r.max_draft > 0 and r.tokens]
        if not requests:
            return {}
        starts = [len(r.tokens) - 1 for r in requests]
        for r, start in zip(requests, starts):
            if start > 0 and (start - 1) // self.block_size >= len(r.blocks):
                raise coverage_error(r.seq, start - 1, self.block_size, len(r.blocks))
        drafts: dict[int, list[int]] = {}
        owners = self.export.max_owners
        for lo in range(0, len(requests), owners):
            part, part_starts = requests[lo:lo + owners], starts[lo:lo + owners]
            inputs = self.block_inputs(part, part_starts)
            out = self.executor.execute(DRAFT_BLOCK, [inputs[0], inputs[1], dk, dv, *inputs[2:]])[0]
            rows = out.reshape(len(part), self.max_draft).tolist()
            drafts.update({r.seq: rows[b][:r.max_draft] for b, r in enumerate(part)})
        return drafts

    def block_inputs(self, requests: Sequence[DraftRequest], starts: Sequence[int]) -> list[torch.Tensor]:
        """``ids``, ``positions``, ``context_slots``, ``full_bias``, ``window_bias``, ``mask_rows``
        of one call."""
        c, n = self.config, self.max_draft
        ids = torch.full((len(requests), n + 1), c.mask_token_id, dtype=torch.long)
        ids[:, 0] = torch.tensor([r.tokens[-1] for r in requests], dtype=torch.long)
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(n + 1)
        slots, key_pos, valid = gather_context(c, self.block_size, starts, [r.blocks for r in requests],
                                               torch.device("cpu"))
        if slots.shape[1] == 0:  # no context yet: one hidden dummy key keeps the inputs well formed
            slots = torch.zeros(len(requests), 1, dtype=torch.long)
            key_pos = torch.zeros(len(requests), 1, dtype=torch.long)
            valid = torch.zeros(len(requests), 1, dtype=torch.bool)
        visible = valid[:, None, :].expand(-1, n + 1, -1)
        zero, hidden = torch.tensor(0.0), torch.tensor(NEG_INF)
        full_bias = torch.where(visible, zero, hidden).contiguous()
        if c.sliding_window is None:
            window_bias = full_bias
        else:
            near = (positions[:, :, None] - key_pos[:, None, :]).abs() <= c.sliding_window
            window_bias = torch.where(visible & near, zero, hidden).contiguous()
        mask_rows = (torch.arange(len(requests))[:, None] * (n + 1) + torch.arange(1, n + 1)).reshape(-1)
        return [ids, positions, slots, full_bias, window_bias, mask_rows]

    def observe(self, step: Step, output: StepOutput, committed: dict[int, int]) -> None:
        """Store the context K/V of every committed row of the step."""
        dk, dv = self._pool()
        kept = kept_rows(step, output, committed, self.block_size, torch.device("cpu"), self.dtype)
        if kept is None:
            return
        self.blocks += kept.verify_blocks
        self.committed_tokens += kept.verify_tokens
        rows = kept.features
        at = torch.tensor(kept.slots, dtype=torch.long)
        where = torch.tensor(kept.positions, dtype=torch.long)
        most = self.executor.manifest.limits.max_prefill_chunk
        for lo in range(0, rows.shape[0], most):
            k, v = self.executor.execute(DRAFT_CONTEXT, [rows[lo:lo + most].contiguous(), where[lo:lo + most]])
            dk[:, at[lo:lo + most]] = k
            dv[:, at[lo:lo + most]] = v

    @property
    def mean_acceptance_length(self) -> float:
        """Mean tokens committed per verify block (accepted drafts + the target's own token)."""
        return self.committed_tokens / self.blocks if self.blocks else 0.0

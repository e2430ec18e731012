"""Per-sequence penalty counts kept on the device for the sampler graphs.

A penalized row counts every id of its sequence so far (the repetition
penalty: every id seen, prompt included; the frequency and presence
penalties: how often each id was generated after the prompt). Sent afresh
each step, that is host work proportional to the whole history (the history
arrives as a Python list). :class:`PenaltyCounts` keeps, per decoding
sequence, one row of a device pool: ``seen`` (1 where the id was counted)
and ``generated`` (float32 counts after the prompt). Each step adds only the
ids counted since the sequence's last step, after checking on the host that
what was counted before is a prefix of the row's counted ids now (one list
comparison; anything else, a rewind say, recounts the row from scratch). The
sampler graph reads the rows through each sampled row's slot; rows without
one read an all-zero slot, for which the penalty formula changes nothing.

The counts are the integers :func:`musegl_core.engine.sample_rows.penalty_counts`
gives (float32 sums of ones), so the result is the eager sampler's.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import numpy as np
import torch


@attrs.define
class _Counted:
    slot: int
    prompt_len: int
    ids: list[int]  # what the slot has counted: a prefix of the row's counted ids
    used: int  # the counter value of its last step


class PenaltyCounts:
    """``slots`` pool rows (plus an all-zero one, :attr:`zero`) of per-sequence counts."""

    def __init__(self, slots: int, vocab: int, device: torch.device) -> None:
        self.slots = slots
        self.vocab = vocab
        self.device = device
        self.zero = slots  # the row every row without a slot reads
        self.seen = torch.zeros(slots + 1, vocab, dtype=torch.bool, device=device)
        self.generated = torch.zeros(slots + 1, vocab, dtype=torch.float32, device=device)
        self._of: dict[int, _Counted] = {}
        self._free = list(range(slots - 1, -1, -1))
        self._clock = 0
        self.recounted = 0  # rows counted from scratch (tests and logs read it)

    def assign(self, seqs: Sequence[int | None], counted: Sequence[tuple[Sequence[int], int]]) -> list[int | None]:
        """For each sampled row: its sequence (None: the row has no slot, e.g. a row of a
        multi-row chunk) and its counted ids with the prompt length. Brings each
        sequence's pool row up to date (queued on the device) and returns the rows'
        slots; None where no slot is left (those rows count on the host)."""
        self._clock += 1
        now = self._clock
        out: list[int | None] = []
        present = {seq for seq in seqs if seq is not None}
        for seq, (ids, prompt_len) in zip(seqs, counted):
            if seq is None:
                out.append(None)
                continue
            state = self._of.get(seq)
            if state is None:
                slot = self._take(present)
                if slot is None:
                    out.append(None)
                    continue
                state = self._of[seq] = _Counted(slot, prompt_len, [], now)
                self._reset(slot)
            n = len(state.ids)
            if n and (state.prompt_len != prompt_len or len(ids) < n or (ids[:n] if type(ids) is list else list(ids[:n])) != state.ids):
                self._reset(state.slot)  # not a continuation of what the slot counted: count again
                state.prompt_len, state.ids, n = prompt_len, [], 0
            if not n:
                self.recounted += 1
                state.prompt_len = prompt_len
            new = list(ids[n:])
            self._add(state.slot, new, n, prompt_len)
            state.ids.extend(new)
            state.used = now
            out.append(state.slot)
        return out

    def release(self, seq: int) -> None:
        """The sequence ended: its slot is free (cleared when it is given again)."""
        state = self._of.pop(seq, None)
        if state is not None:
            self._free.append(state.slot)

    def _take(self, present: set[int]) -> int | None:
        """A free slot, else that of the least recently used sequence not in this step."""
        if self._free:
            return self._free.pop()
        idle = [(s.used, seq) for seq, s in self._of.items() if seq not in present]
        if not idle:
            return None
        _, seq = min(idle)  # the least recently used sequence gives its slot up
        return self._of.pop(seq).slot

    def _reset(self, slot: int) -> None:
        self.seen[slot].zero_()
        self.generated[slot].zero_()

    def _add(self, slot: int, new: list[int], start: int, prompt_len: int) -> None:
        """Count ``new`` (the row's counted ids from index ``start`` on) into ``slot``."""
        if not new:
            return
        ids = np.asarray(new, dtype=np.int64)
        inside = (ids >= 0) & (ids < self.vocab)
        seen = torch.from_numpy(ids[inside]).to(self.device, non_blocking=True)
        self.seen[slot].index_fill_(0, seen, True)
        generated = ids[max(0, prompt_len - start):]
        generated = generated[(generated >= 0) & (generated < self.vocab)]
        if len(generated):
            index = torch.from_numpy(generated).to(self.device, non_blocking=True)
            self.generated[slot].index_add_(0, index, torch.ones(len(generated), device=self.device))

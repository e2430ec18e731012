"""Verify blocks whose drafts are on the device (``SeqChunk.draft_row``, ``Step.drafts``).

The engine sends a verify block's draft rows as placeholders when the drafts
never left the device (a DFlash draft forward, queued just before the step).
:class:`DraftRows` says where they go: :meth:`DraftRows.place` writes the
draft ids into the step's token tensor on the device (the graphs' static
tokens or an eager step's), before the forward runs; after the step's ids
exist on the device (the graph's argmax, or the sampler's draws)
:meth:`DraftRows.judge` compares them with the drafts there and queues the
copy of one count per block into host memory (:class:`Accepted`), queued
behind the step, so the engine waits for the device once per step (a launch
whose ids are not one device tensor copies the drafts back instead and
compares on the host: :class:`HostJudged`).

Block ``c`` with drafts ``d_0 .. d_{k-1}`` (rows ``1 .. k``) and sampled ids
``s_0 .. s_k`` accepts ``d_j`` when ``d_j == s_j`` and every draft before it
was accepted: the rule of :func:`musegl_core.engine.speculator.accept`.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from musegl_core.engine.executor import Step, StepOutput
from musegl_core.engine.speculator import accept
from musegl_cuda.sampling import on_device


def copy_to_host(values: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Queue the copy of a small device tensor into pinned host memory: (the host
    tensor, an event recorded after the copy; None on the CPU, where it is done)."""
    pinned = values.device.type == "cuda"
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
    host.copy_(values, non_blocking=pinned)
    if not pinned:
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


class Accepted:
    """The accepted counts of a step's device-draft blocks, computed on the device and
    copied into host memory behind the step."""

    def __init__(self, seqs: Sequence[int], counts: torch.Tensor) -> None:
        self.seqs = list(seqs)
        self.host, self.event = copy_to_host(counts)

    def values(self, output: StepOutput) -> dict[int, int]:
        if self.event is not None:
            self.event.synchronize()
        return dict(zip(self.seqs, self.host.tolist()))


class HostJudged:
    """The fallback for a launch whose sampled ids are not on the device as one
    tensor: the drafts are copied back and compared on the host (:func:`accept`)."""

    def __init__(self, drafted: "DraftRows") -> None:
        self.drafted = drafted
        drafts = drafted.drafts
        self.host, self.event = copy_to_host(
            drafts.reshape(-1).index_select(0, on_device(drafted.flat, drafts.device, torch.long)))

    def values(self, output: StepOutput) -> dict[int, int]:
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        found, at = {}, 0
        for seq, k in zip(self.drafted.seqs, self.drafted.counts):
            found[seq] = len(accept(values[at:at + k], output.tokens[seq])) - 1
            at += k
        return found


@attrs.frozen(eq=False)
class DraftRows:
    """The device-draft blocks of one step, laid out for placing and judging.

    ``rows[i]``/``flat[i]``: a packed row whose token is a draft and that
    draft's index into ``step.drafts.reshape(-1)``. Per block ``c`` (a chunk
    with a ``draft_row``): ``seqs[c]``, ``counts[c]`` drafts, ``row_base[c]``
    its first packed row and ``sample_base[c]`` its first sampled row's index
    among the step's sampled rows (the order the sampler returns ids in)."""

    rows: list[int]
    flat: list[int]
    seqs: list[int]
    draft_rows: list[int]
    counts: list[int]
    row_base: list[int]
    sample_base: list[int]
    drafts: torch.Tensor  # the step's drafts (``Step.drafts``)

    @classmethod
    def of(cls, step: Step, starts: Sequence[int]) -> "DraftRows | None":
        """None when no chunk of ``step`` reads drafts on the device."""
        if step.drafts is None or all(ch.draft_row < 0 for ch in step.chunks):
            return None
        drafts = torch.as_tensor(step.drafts)  # a torch tensor (no copy), or numpy
        stride = int(drafts.shape[1])
        rows, flat, seqs, draft_rows, counts, row_base, sample_base = [], [], [], [], [], [], []
        sampled = 0
        for chunk, start in zip(step.chunks, starts):
            if chunk.draft_row >= 0:
                k = len(chunk.tokens) - 1
                if not 0 <= chunk.draft_row < drafts.shape[0] or k > stride:
                    raise ValueError(f"sequence {chunk.seq}: {k} drafts at row {chunk.draft_row} are outside the "
                                     f"step's drafts {tuple(drafts.shape)}")
                rows.extend(range(int(start) + 1, int(start) + 1 + k))
                flat.extend(range(chunk.draft_row * stride, chunk.draft_row * stride + k))
                seqs.append(chunk.seq)
                draft_rows.append(chunk.draft_row)
                counts.append(k)
                row_base.append(int(start))
                sample_base.append(sampled)
            sampled += chunk.sample
        return cls(rows, flat, seqs, draft_rows, counts, row_base, sample_base, drafts.long())

    @property
    def stride(self) -> int:
        return int(self.drafts.shape[1])

    def place(self, tokens: torch.Tensor) -> None:
        """Write the drafts into their rows of ``tokens`` (queued on its device)."""
        device = tokens.device
        values = self.drafts.reshape(-1).to(device).index_select(0, on_device(self.flat, device, torch.long))
        tokens.index_copy_(0, on_device(self.rows, device, torch.long), values.to(tokens.dtype))

    def judge(self, ids: torch.Tensor | None, by_row: bool) -> "Accepted | HostJudged":
        """Compare ``ids`` (the step's sampled ids on the device: per packed row when
        ``by_row``, else in sampled-row order) with the drafts and queue the copy of
        the accepted counts; ``ids`` None: :class:`HostJudged`."""
        drafts = self.drafts
        if ids is None:
            return HostJudged(self)
        device = ids.device
        width = max(self.counts)
        bases = self.row_base if by_row else self.sample_base
        at, want, valid = [], [], []
        for base, row, k in zip(bases, self.draft_rows, self.counts):
            at.extend(base + j if j < k else 0 for j in range(width))
            want.extend(row * self.stride + j if j < k else 0 for j in range(width))
            valid.extend(j < k for j in range(width))
        shape = (len(self.counts), width)
        sampled = ids.index_select(0, on_device(at, device, torch.long)).view(shape)
        drafted = drafts.reshape(-1).to(device).index_select(0, on_device(want, device, torch.long)).view(shape)
        agree = (sampled == drafted) & on_device(valid, device, torch.bool).view(shape)
        return Accepted(self.seqs, agree.long().cumprod(dim=1).sum(dim=1))

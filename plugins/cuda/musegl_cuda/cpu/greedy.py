"""Greedy ids of softcapped logits on the CPU without the softcap of every vocabulary entry.

The head's softcap (``×multiplier, ÷cap, tanh, ×cap``, :meth:`~musegl_cuda.model.MuseGlimmerDecoder.logits`)
costs a decode step more than the rest of its glue: ``tanh`` of 202,048 entries is ~0.5 ms
of one core, the ``argmax`` over them another ~0.2 ms. A greedy row needs only the id of
its largest softcapped value. :func:`capped_argmax` finds that id exactly, the one
``torch.argmax`` gives on the full chain's result (the first id of the largest value): the
scaled logits ``u = z × multiplier ÷ cap`` are computed as the chain computes them, and
``tanh`` runs only on the blocks of entries whose ``u`` lies so close to the row's largest
``u`` that their softcapped value could equal or pass the largest one's. Every other
entry's true ``tanh`` is at least ``MARGIN_ULPS`` float32 ulps below the largest entry's,
far beyond the error of torch's ``tanh`` (1 ulp), so its softcapped value is strictly
smaller. ``tanh`` runs on aligned :data:`BLOCK`-entry slices of the flattened logits, so each
entry goes through the same vector or scalar code as in the full chain. Rows with a NaN or
an infinite ``u`` and rows whose candidates are too many (saturated logits) give None: the
caller runs the full chain.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: tanh runs on slices of this many entries of the flattened logits, aligned to the start
#: (a multiple of any vector loop's step, so an entry takes the same code path as in the full chain).
BLOCK = 256
#: How far (float32 ulps of the row's largest tanh) below the largest entry a candidate may lie.
MARGIN_ULPS = 64
#: More candidates than this in a step (saturated logits): the full chain is cheaper.
MAX_CANDIDATES = 4096


def _threshold(top: float) -> float | None:
    """The float32 value below which an entry's ``u`` cannot reach the softcapped value of
    a row whose largest ``u`` is ``top`` (None: no useful bound, run the full chain)."""
    if not math.isfinite(top):
        return None
    t = math.tanh(top)
    lower = t - MARGIN_ULPS * float(np.spacing(np.float32(abs(t))))
    if lower <= -1.0:
        return None
    bound = np.float32(math.atanh(lower))
    return float(np.nextafter(bound, np.float32(-np.inf)))  # rounded down: never excludes more


def capped_argmax(u: torch.Tensor, cap: float) -> torch.Tensor | None:
    """Per row of ``u`` (float32 ``(rows, vocab)``, contiguous: the head's output after
    ``×multiplier ÷cap``, which the chain turns into ``tanh(u) × cap``), the index
    ``torch.argmax(u.tanh() * cap, dim=-1)`` gives (int64), computed without the ``tanh``
    of every entry; None where it does not apply (see the module docstring). ``u`` is not
    changed. Run on one torch thread, as the full chain of a decode step runs."""
    rows, vocab = u.shape
    if not u.is_contiguous() or u.dtype != torch.float32 or torch.get_num_threads() != 1:
        return None
    values = u.numpy()  # the same memory: numpy's max and compare cost a tenth of torch's here
    flat = u.view(-1)
    capped: dict[int, list[float]] = {}  # block -> tanh(u) × cap of its entries
    ids = []
    for r in range(rows):
        bound = _threshold(float(values[r].max()))
        if bound is None:
            return None
        found = np.flatnonzero(values[r] >= np.float32(bound))
        if found.size > MAX_CANDIDATES:
            return None
        best, best_id = -math.inf, -1
        for c in found.tolist():  # increasing: the first of equal values stays
            i = r * vocab + c
            block = i // BLOCK
            done = capped.get(block)
            if done is None:
                done = capped[block] = flat[block * BLOCK:(block + 1) * BLOCK].clone().tanh_().mul_(cap).tolist()
            if done[i - block * BLOCK] > best:
                best, best_id = done[i - block * BLOCK], c
        if best_id < 0:  # cannot happen: the row's largest entry is a candidate
            return None
        ids.append(best_id)
    return torch.tensor(ids, dtype=torch.long)

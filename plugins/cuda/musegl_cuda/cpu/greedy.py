"""Greedy ids of softcapped logits on the CPU without the softcap of every vocabulary entry.

The head's softcap (``×multiplier, ÷cap, tanh, ×cap``, :meth:`~musegl_cuda.model.MuseGlimmerDecoder.logits`)
costs a decode step more than the rest of its glue: ``tanh`` of 202,048 entries is ~0.5 ms
of one core, the ``argmax`` over them another ~0.2 ms. A greedy row needs only the id of
its largest softcapped value. :func:`capped_argmax` finds that id exactly, the one
``torch.argmax`` gives on the full chain's result (the first id of the largest value): from
a row's largest raw logit it bounds which raw logits lie so close that their softcapped value
could equal or pass the largest one's, and runs the chain (the same torch ops) only on the
blocks holding them. Every other entry's true ``tanh`` is at least :data:`MARGIN_ULPS`
float32 ulps below the largest entry's, far beyond the error of torch's ``tanh`` (1 ulp) and
the chain's roundings, so its softcapped value is strictly smaller. The chain runs on aligned
:data:`BLOCK`-entry slices of the flattened logits, so each entry goes through the same vector
or scalar code as in the full chain. Rows with a NaN or an infinite logit and rows whose
candidates are too many (saturated logits) give None: the caller runs the full chain.
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


def _threshold(top: float, multiplier: float, cap: float) -> float | None:
    """The float32 value below which a raw logit cannot reach the softcapped value of a row
    whose largest raw logit is ``top`` (None: no useful bound, run the full chain)."""
    if not math.isfinite(top):
        return None
    scale = multiplier / cap
    t = math.tanh(top * scale)  # the row's largest tanh, to float32's ~1e-7
    lower = t - MARGIN_ULPS * float(np.spacing(np.float32(abs(t))))
    if lower <= -1.0:
        return None
    u = math.atanh(lower)  # every entry whose scaled logit lies below u is a non-candidate
    bound = np.float32((u - abs(u) * 1e-5) / scale)  # back to raw logits; 1e-5 covers the chain's float32 rounding
    return float(np.nextafter(bound, np.float32(-np.inf)))  # rounded down: never excludes more


def capped_argmax(z: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor | None:
    """Per row of ``z`` (float32 ``(rows, vocab)``, contiguous: the head's raw output), the
    index ``torch.argmax`` gives on the softcap chain's result
    ``z.mul_(multiplier).div_(cap).tanh_().mul_(cap)``, computed without running the chain on
    every entry; None where it does not apply (see the module docstring). ``z`` is not
    changed. Run on one torch thread, as the full chain of a decode step runs."""
    rows, vocab = z.shape
    if not z.is_contiguous() or z.dtype != torch.float32 or torch.get_num_threads() != 1 or multiplier <= 0:
        return None
    values = z.numpy()  # the same memory: numpy's max and compare cost a tenth of torch's here
    flat = z.view(-1)
    capped: dict[int, list[float]] = {}  # block -> the chain's values of its entries
    ids = []
    for r in range(rows):
        row = values[r]
        top = int(row.argmax())  # the first largest (a NaN's index where the row has one)
        bound = _threshold(float(row[top]), multiplier, cap)
        if bound is None:
            return None
        runner_up = max(float(row[:top].max()) if top else -math.inf,
                        float(row[top + 1:].max()) if top + 1 < vocab else -math.inf)
        if runner_up < bound:  # the usual case: no other candidate, the largest raw logit's id
            ids.append(top)
            continue
        found = np.flatnonzero(row >= np.float32(bound))
        if found.size > MAX_CANDIDATES:
            return None
        best, best_id = -math.inf, -1
        for c in found.tolist():  # increasing: the first of equal values stays
            i = r * vocab + c
            block = i // BLOCK
            done = capped.get(block)
            if done is None:
                done = capped[block] = (flat[block * BLOCK:(block + 1) * BLOCK].mul(multiplier).div_(cap)
                                        .tanh_().mul_(cap).tolist())
            if done[i - block * BLOCK] > best:
                best, best_id = done[i - block * BLOCK], c
        if best_id < 0:  # cannot happen: the row's largest entry is a candidate
            return None
        ids.append(best_id)
    return torch.tensor(ids, dtype=torch.long)

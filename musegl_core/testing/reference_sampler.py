"""The executor contract's sampling rule (docs/executor.md section 5) in plain numpy.

A readable float64 reference for backend authors: given one sampled row's
float32 logits and what the step carried for it, :func:`sample_row` returns
the id the contract says the row draws, and :func:`row_logprobs` the
log-probabilities an executor reports. :mod:`musegl_core.testing.conformance`
checks an executor's own sampler against it, on the executor's own logits.

It is slow (one row at a time, float64) and never used to serve.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from musegl_core.engine.executor import SamplingParams, TokenLogprobs
from musegl_core.engine.sample_rows import unpack_mask as allowed_ids

__all__ = ["RowContext", "allowed_ids", "processed_logits", "row_logprobs", "sample_row"]


@attrs.frozen
class RowContext:
    """What the step carried for one sampled row besides its logits.

    ``history`` is every id before the row's token plus the chunk's tokens up to
    and including the row (the ids the penalties count); ``prompt_len`` of them
    are the prompt (counted only by the repetition penalty)."""

    uniform: float = 0.5
    mask: Any = None
    history: Sequence[int] = ()
    prompt_len: int = 0


def processed_logits(logits: Any, params: SamplingParams, row: RowContext = RowContext()) -> np.ndarray:
    """Step 1 of the rule: logit bias, the penalties, the mask (float64, ``-inf`` for banned ids)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    for token, bias in params.logit_bias:
        z[token] += bias
    if params.penalized and len(row.history):
        ids = np.asarray(row.history, dtype=np.int64)
        if params.repetition_penalty != 1.0:
            seen = np.unique(ids)
            z[seen] = np.where(z[seen] > 0, z[seen] / params.repetition_penalty, z[seen] * params.repetition_penalty)
        generated = ids[row.prompt_len:]
        if len(generated) and (params.frequency_penalty or params.presence_penalty):
            counts = np.bincount(generated, minlength=len(z))[: len(z)]
            z -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
    if row.mask is not None:
        z = np.where(allowed_ids(row.mask, len(z)), z, -np.inf)
    return z


def sample_row(logits: Any, params: SamplingParams, row: RowContext = RowContext()) -> int:
    """The id the contract draws for one row (steps 1-3 of section 5)."""
    z = processed_logits(logits, params, row)
    if params.greedy:
        return int(np.argmax(z))  # numpy's argmax takes the lowest id on ties, as the rule says
    z = z / params.temperature
    keep = np.isfinite(z)
    if 0 < params.top_k < len(z):
        kth = np.sort(z)[-params.top_k]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order]) / p.sum()
        cut = int(np.searchsorted(mass, params.top_p)) + 1  # the smallest set reaching top_p
        dropped = order[cut:]
        p[dropped] = 0.0
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    cdf = np.cumsum(p)
    chosen = int(np.searchsorted(cdf, row.uniform * cdf[-1], side="right"))
    return min(chosen, len(z) - 1)


def row_logprobs(logits: Any, params: SamplingParams, chosen: int, top: int,
                 row: RowContext = RowContext()) -> TokenLogprobs:
    """The log-probabilities an executor reports for a row: under the distribution after
    step 1 and the temperature, before top-k/top-p/min-p (greedy rows: temperature 1)."""
    z = processed_logits(logits, params, row)
    if not params.greedy:
        z = z / params.temperature
    finite = z[np.isfinite(z)]
    log_total = finite.max() + np.log(np.exp(finite - finite.max()).sum())
    logp = z - log_total
    order = np.argsort(-logp, kind="stable")[:top]
    return TokenLogprobs(float(logp[chosen]), tuple(int(i) for i in order), tuple(float(logp[i]) for i in order))

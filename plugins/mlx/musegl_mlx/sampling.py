"""Batched sampling in MLX: one call per step for every sampled row.

The same chain as the torch executor's sampler (``musegl_cuda/sampling.py``)
and ``docs/executor.md`` section 5, over one ``(rows, vocab)`` float32
logits matrix:

1. logits processors: ``logit_bias`` (scatter-add), the repetition,
   frequency and presence penalties (from per-row id counts made on the
   host), the allowed-token masks (bitmasks unpacked on the host);
2. greedy rows: argmax (lowest id on ties). Other rows: temperature,
   top-k, top-p, min-p as masks over each row;
3. the draw: inverse CDF with the row's uniform number (keyed by seed and
   position in the engine), so a row's token never depends on the others.

Only the chosen ids (and requested top-n log-probabilities) come back to
the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from musegl_core.engine.executor import SamplingParams, TokenLogprobs
from musegl_core.engine.sample_rows import SampleRows, bias_entries, penalty_counts
from musegl_core.engine.sample_rows import unpack_masks as allowed_matrix

__all__ = ["SampleRows", "apply_processors", "filter_logits", "draw", "penalty_counts", "sample", "unpack_masks"]


def unpack_masks(masks: list[np.ndarray | None], vocab: int) -> mx.array | None:
    """``(rows, vocab)`` bool of allowed ids (:func:`musegl_core.engine.sample_rows.unpack_masks`),
    or None when no row has a mask."""
    bits = allowed_matrix(masks, vocab)
    return None if bits is None else mx.array(bits)


def apply_processors(z: mx.array, rows: SampleRows) -> mx.array:
    """Bias, penalties and masks, batched over the rows."""
    n, vocab = z.shape
    bias = bias_entries(rows, vocab)
    if bias is not None:
        r, c, v = bias
        z = z.at[mx.array(r.astype(np.int32)), mx.array(c.astype(np.int32))].add(mx.array(v))
    penalized = rows.penalized
    if penalized:
        seen, generated = penalty_counts(rows, penalized, vocab)
        params = [rows.params[i] for i in penalized]
        index = mx.array(np.array(penalized, dtype=np.int32))
        sub = z[index]
        rep = mx.array(np.array([p.repetition_penalty for p in params], dtype=np.float32))[:, None]
        sub = mx.where(mx.array(seen), mx.where(sub > 0, sub / rep, sub * rep), sub)
        freq = mx.array(np.array([p.frequency_penalty for p in params], dtype=np.float32))[:, None]
        pres = mx.array(np.array([p.presence_penalty for p in params], dtype=np.float32))[:, None]
        counts = mx.array(generated)
        sub = sub - counts * freq - (counts > 0).astype(mx.float32) * pres
        z[index] = sub
    allowed = unpack_masks(rows.masks, vocab)
    if allowed is not None:
        z = mx.where(allowed, z, -mx.inf)
    return z


def filter_logits(z: mx.array, params: list[SamplingParams]) -> mx.array:
    """Temperature, top-k, top-p and min-p on ``(rows, vocab)`` float32 logits, removed
    entries ``-inf``: the rules of docs/executor.md section 5 (ties at the k-th value kept,
    the most likely id always kept), operation for operation as the torch sampler."""
    temperature = mx.array(np.array([max(p.temperature, 1e-6) for p in params], dtype=np.float32))[:, None]
    z = z / temperature
    vocab = z.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    need_sort = any(ks) or any(p.top_p < 1.0 for p in params)
    if need_sort:
        order = mx.argsort(-z, axis=-1)  # descending
        sorted_z = mx.take_along_axis(z, order, axis=-1)
    if any(ks):
        k_index = mx.array(np.array([[max(k, 1) - 1] for k in ks], dtype=np.int32))
        kth = mx.take_along_axis(sorted_z, k_index, axis=-1)
        active = mx.array(np.array([[bool(k)] for k in ks]))
        z = mx.where(active & (z < kth), -mx.inf, z)
    if any(p.top_p < 1.0 for p in params):
        top_p = mx.array(np.array([[p.top_p] for p in params], dtype=np.float32))
        sorted_z = mx.take_along_axis(z, order, axis=-1)  # after top-k, same order
        probs = mx.softmax(sorted_z, axis=-1)
        mass_before = mx.cumsum(probs, axis=-1) - probs
        drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
        first = mx.arange(vocab)[None, :] == 0
        drop_sorted = drop_sorted & ~first
        # back to vocabulary order: position order[r, j] takes drop_sorted[r, j]
        drop = mx.zeros(drop_sorted.shape, dtype=mx.bool_)
        drop = mx.put_along_axis(drop, order, drop_sorted, axis=-1)
        z = mx.where(drop, -mx.inf, z)
    if any(p.min_p > 0.0 for p in params):
        min_p = mx.array(np.array([[p.min_p] for p in params], dtype=np.float32))
        probs = mx.softmax(z, axis=-1)
        floor = mx.max(probs, axis=-1, keepdims=True) * min_p
        z = mx.where(probs < floor, -mx.inf, z)
    return z


def draw(z: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse-CDF draw per row over the ids in vocabulary order: the first id
    whose cumulative probability exceeds ``u`` times the row's total."""
    probs = mx.softmax(z, axis=-1)
    cdf = mx.cumsum(probs, axis=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    ids = mx.sum(cdf <= target, axis=-1)  # searchsorted(cdf, target, right=True)
    return mx.minimum(ids, z.shape[-1] - 1)


def sample(logits: mx.array, rows: SampleRows) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample every row of ``logits`` (``(rows, vocab)`` float32): ids, and
    log-probabilities for the rows that asked for them."""
    if not len(rows):
        return [], []
    z = logits.astype(mx.float32)
    if rows.processed:
        z = apply_processors(z, rows)
    greedy = [p.greedy for p in rows.params]
    chosen = mx.argmax(z, axis=-1).astype(mx.int32)
    if not all(greedy):
        filtered = filter_logits(z, rows.params)
        uniforms = mx.clip(mx.array(np.array(rows.uniforms, dtype=np.float32)), 0.0, 1.0 - 2**-24)
        drawn = draw(filtered, uniforms).astype(mx.int32)
        chosen = mx.where(mx.array(np.array(greedy)), chosen, drawn)
    wanted = rows.wanted
    if not wanted:
        return chosen.tolist(), [None] * len(rows)
    index = mx.array(np.array(wanted, dtype=np.int32))
    temperature = mx.array(np.array([[rows.params[i].temperature if not rows.params[i].greedy else 1.0]
                                     for i in wanted], dtype=np.float32))
    scaled = z[index] / temperature
    lp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    picked = mx.take_along_axis(lp, chosen[index][:, None], axis=-1)[:, 0]
    top_n = max(rows.logprobs[i] for i in wanted)
    top_ids = mx.argsort(-lp, axis=-1)[:, :top_n] if top_n else None
    top_vals = mx.take_along_axis(lp, top_ids, axis=-1) if top_ids is not None else None
    mx.eval(chosen, picked, *(a for a in (top_ids, top_vals) if a is not None))
    ids = chosen.tolist()
    picked_l = picked.tolist()
    ids_l = top_ids.tolist() if top_ids is not None else [[] for _ in wanted]
    vals_l = top_vals.tolist() if top_vals is not None else [[] for _ in wanted]
    logprobs: list[TokenLogprobs | None] = [None] * len(ids)
    for k, i in enumerate(wanted):
        n = rows.logprobs[i]
        logprobs[i] = TokenLogprobs(picked_l[k], tuple(ids_l[k][:n]), tuple(vals_l[k][:n]))
    return ids, logprobs

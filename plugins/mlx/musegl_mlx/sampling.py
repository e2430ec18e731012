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

from typing import Sequence

import attrs
import mlx.core as mx
import numpy as np

from musegl_core.engine.executor import SamplingParams, SeqChunk, TokenLogprobs


@attrs.define
class SampleRows:
    """The sampled rows of a step, in order, with what each needs."""

    params: list[SamplingParams] = attrs.field(factory=list)
    uniforms: list[float] = attrs.field(factory=list)
    masks: list[np.ndarray | None] = attrs.field(factory=list)
    counted: list[tuple[Sequence[int], int]] = attrs.field(factory=list)  # (ids, prompt part) for penalties
    logprobs: list[int] = attrs.field(factory=list)

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


def unpack_masks(masks: list[np.ndarray | None], vocab: int) -> mx.array | None:
    """``(rows, vocab)`` bool of allowed ids, or None when no row has a mask."""
    if all(m is None for m in masks):
        return None
    words = -(-vocab // 32)
    packed = np.full((len(masks), words), 0xFFFFFFFF, dtype=np.uint32)
    for i, m in enumerate(masks):
        if m is not None:
            packed[i] = np.asarray(m, dtype=np.uint32)[:words]
    bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return mx.array(bits.astype(np.bool_))


def penalty_counts(rows: SampleRows, index: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """For the penalized rows ``index``: ``seen`` (every counted id, prompt
    included) and ``generated`` (occurrences after the prompt), ``(n, vocab)``."""
    seen = np.zeros((len(index), vocab), dtype=np.bool_)
    generated = np.zeros((len(index), vocab), dtype=np.float32)
    for k, i in enumerate(index):
        ids, prompt_len = rows.counted[i]
        all_ids = np.asarray(list(ids), dtype=np.int64)
        seen[k, all_ids[(all_ids >= 0) & (all_ids < vocab)]] = True
        gen = all_ids[prompt_len:]
        np.add.at(generated[k], gen[(gen >= 0) & (gen < vocab)], 1.0)
    return seen, generated


def apply_processors(z: mx.array, rows: SampleRows) -> mx.array:
    """Bias, penalties and masks, batched over the rows."""
    n, vocab = z.shape
    biased = [(i, p.logit_bias) for i, p in enumerate(rows.params) if p.logit_bias]
    if biased:
        entries = [(i, t, x) for i, b in biased for t, x in b if 0 <= t < vocab]
        if entries:
            r, c, v = (np.array(col) for col in zip(*entries))
            z = z.at[mx.array(r.astype(np.int32)), mx.array(c.astype(np.int32))].add(
                mx.array(v.astype(np.float32)))
    penalized = [i for i, p in enumerate(rows.params) if p.penalized]
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
    """Temperature, top-k, top-p and min-p on ``(rows, vocab)`` float32 logits;
    removed entries become ``-inf``. top-k keeps the ``k`` largest values
    (ties at the k-th value kept); top-p keeps the smallest prefix of the
    sorted distribution whose mass reaches ``top_p`` (always the most likely
    id); min-p keeps ids whose probability is at least ``min_p`` times the
    largest."""
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
    if any(p.logit_bias or p.penalized for p in rows.params) or any(m is not None for m in rows.masks):
        z = apply_processors(z, rows)
    greedy = [p.greedy for p in rows.params]
    chosen = mx.argmax(z, axis=-1).astype(mx.int32)
    if not all(greedy):
        filtered = filter_logits(z, rows.params)
        uniforms = mx.clip(mx.array(np.array(rows.uniforms, dtype=np.float32)), 0.0, 1.0 - 2**-24)
        drawn = draw(filtered, uniforms).astype(mx.int32)
        chosen = mx.where(mx.array(np.array(greedy)), chosen, drawn)
    wanted = [i for i, n in enumerate(rows.logprobs) if n >= 0]
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

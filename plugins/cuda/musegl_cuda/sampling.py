"""Batched sampling on the executor's device: one call per step for every sampled row.

The rows of all chunks that sample are gathered into one ``(rows, vocab)``
float32 logits matrix and go through one chain of batched operations, in the
order :class:`~musegl_core.engine.executor.SamplingParams` documents:

1. logits processors: ``logit_bias`` (scatter-add), the repetition, frequency
   and presence penalties (from per-row id counts), the allowed-token masks
   (unpacked from the bitmasks the engine's processors produced);
2. temperature, top-k, top-p, min-p as masks over each row;
3. the draw: argmax for greedy rows, otherwise inverse CDF with the row's
   uniform number (keyed by seed and position in the engine), so a row's
   token never depends on the other rows.

Only the chosen ids (and the requested top-n log-probabilities) are copied
to the host, once per step.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from musegl_core.engine.executor import SamplingParams, TokenLogprobs
from musegl_core.engine.sample_rows import SampleRows, bias_entries, penalty_counts
from musegl_core.engine.sample_rows import unpack_masks as allowed_matrix

__all__ = ["Draw", "SampleRows", "choose", "on_device", "sample", "top_logprobs", "unpack_masks"]

NEG_INF = float("-inf")


def on_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on ``device``, queued behind the device's work
    instead of waiting for it (``torch.tensor(..., device="cuda")`` waits for the
    stream, which would stall a step launched behind another one)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def unpack_masks(masks: list[np.ndarray | None], vocab: int, device: torch.device) -> torch.Tensor | None:
    """``(rows, vocab)`` bool of allowed ids on ``device`` (:func:`musegl_core.engine.sample_rows.unpack_masks`),
    or None when no row has a mask."""
    bits = allowed_matrix(masks, vocab)
    return None if bits is None else torch.from_numpy(bits).to(device, non_blocking=True)


def apply_processors(logits: torch.Tensor, rows: SampleRows) -> torch.Tensor:
    """Bias, penalties and masks, batched over the rows (in place on a float32 copy)."""
    n, vocab = logits.shape
    device = logits.device
    bias = bias_entries(rows, vocab)
    if bias is not None:
        r, c, v = (torch.from_numpy(column).to(device, non_blocking=True) for column in bias)
        logits.index_put_((r, c), v, accumulate=True)
    penalized = rows.penalized
    if penalized:
        seen, generated = penalty_counts(rows, penalized, vocab)
        index = on_device(penalized, device, torch.long)
        sub = logits[index]
        params = [rows.params[i] for i in penalized]
        rep = on_device([p.repetition_penalty for p in params], device)[:, None]
        seen_d = torch.from_numpy(seen).to(device, non_blocking=True)
        sub = torch.where(seen_d, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = on_device([p.frequency_penalty for p in params], device)[:, None]
        pres = on_device([p.presence_penalty for p in params], device)[:, None]
        counts = torch.from_numpy(generated).to(device, non_blocking=True)
        sub = sub - counts * freq - (counts > 0).float() * pres
        logits[index] = sub
    allowed = unpack_masks(rows.masks, vocab, device)
    if allowed is not None:
        logits.masked_fill_(~allowed, NEG_INF)
    return logits


def filter_logits(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on ``(rows, vocab)`` float32 logits;
    removed entries become ``-inf``. top-k keeps the ``k`` largest values
    (ties at the k-th value kept); top-p keeps the smallest prefix of the
    sorted distribution whose mass reaches ``top_p`` (always the most likely
    token); min-p keeps ids whose probability is at least ``min_p`` times the
    largest."""
    device = z.device
    temperature = on_device([max(p.temperature, 1e-6) for p in params], device)[:, None]
    z = z / temperature
    vocab = z.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        kmax = max(ks)
        top = torch.topk(z, kmax, dim=-1).values
        k_index = on_device([max(k, 1) - 1 if k else kmax - 1 for k in ks], device)[:, None]
        kth = top.gather(1, k_index)
        active = on_device([bool(k) for k in ks], device)[:, None]
        z = z.masked_fill(active & (z < kth), NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        top_p = on_device([p.top_p for p in params], device)[:, None]
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        z = z.masked_fill(drop, NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        min_p = on_device([p.min_p for p in params], device)[:, None]
        probs = torch.softmax(z, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p
        z = z.masked_fill(probs < floor, NEG_INF)
    return z


def draw(z: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row over the ids in vocabulary order: the first id
    whose cumulative probability exceeds ``u`` times the row's total."""
    probs = torch.softmax(z, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return ids.clamp_(max=z.shape[-1] - 1)


def top_logprobs(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row of ``lp`` (float32 ``(rows, vocab)``), largest
    first and equal values by lowest id (the reference's order, whatever ``k`` and
    however many rows): ``(ids int64, values float32)``, each ``(rows, k)``. One
    ``topk`` over unique int64 keys: the value's bits mapped to an order-preserving
    integer, then the id."""
    bits = (lp + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0
    ordered = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)
    vocab = lp.shape[-1]
    ids = torch.arange(vocab, dtype=torch.long, device=lp.device)
    keys = ordered * (1 << 32) + (0xFFFFFFFF - ids)
    top = torch.topk(keys, k, dim=-1).indices
    return top, lp.gather(1, top)


@attrs.define
class Draw:
    """The sampled rows of a step as :func:`choose` left them on the device:
    the chosen ids and, for the rows that asked (``wanted``, asking ``counts[k]``
    alternatives), the chosen id's log-probability and the top alternatives.
    :meth:`fetch` starts their copy to the host without waiting; :meth:`lists`
    waits for it and answers."""

    size: int
    chosen: torch.Tensor | None = None
    wanted: list[int] = attrs.field(factory=list)
    counts: list[int] = attrs.field(factory=list)
    picked: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    event: object = None

    def fetch(self) -> "Draw":
        """Queue the copies into pinned host memory (CUDA; a no-op elsewhere)."""
        if self.chosen is None or self.chosen.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        self.chosen, self.picked = pinned(self.chosen), pinned(self.picked)
        self.top_ids, self.top_values = pinned(self.top_ids), pinned(self.top_values)
        self.event = torch.cuda.Event()
        self.event.record()
        return self

    def lists(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The ids, and log-probabilities where asked (waits for :meth:`fetch`'s copies)."""
        if self.event is not None:
            self.event.synchronize()
        if self.chosen is None:
            return [], []
        ids = self.chosen.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(ids)
        if self.wanted:
            picked = self.picked.tolist()
            top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in self.wanted]
            top_values = self.top_values.tolist() if self.top_values is not None else [[] for _ in self.wanted]
            for k, i in enumerate(self.wanted):
                n = self.counts[k]
                logprobs[i] = TokenLogprobs(picked[k], tuple(top_ids[k][:n]), tuple(top_values[k][:n]))
        return ids, logprobs


def choose(logits: torch.Tensor, rows: SampleRows) -> Draw:
    """Sample every row of ``logits`` (``(rows, vocab)`` float32) on its device,
    without waiting for the device: the :class:`Draw` to fetch."""
    if not len(rows):
        return Draw(0)
    device = logits.device
    z = apply_processors(logits.float().clone(), rows) if rows.processed else logits.float()
    greedy = [p.greedy for p in rows.params]
    chosen = torch.argmax(z, dim=-1)
    if not all(greedy):
        filtered = filter_logits(z, rows.params)
        uniforms = on_device(rows.uniforms, device, torch.float32).clamp_(0.0, 1.0 - 2**-24)
        drawn = draw(filtered, uniforms)
        chosen = torch.where(on_device(greedy, device), chosen, drawn)
    out = Draw(len(rows), chosen)
    wanted = rows.wanted
    if wanted:
        index = on_device(wanted, device)
        temperature = on_device([rows.params[i].temperature if not rows.params[i].greedy else 1.0
                                 for i in wanted], device)[:, None]
        lp = torch.log_softmax(z[index] / temperature, dim=-1)
        top_n = max(rows.logprobs[i] for i in wanted)
        out.wanted, out.counts = wanted, [rows.logprobs[i] for i in wanted]
        out.picked = lp.gather(1, chosen[index][:, None]).squeeze(1)
        if top_n:
            out.top_ids, out.top_values = top_logprobs(lp, top_n)
    return out


def sample(logits: torch.Tensor, rows: SampleRows) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample every row of ``logits`` (``(rows, vocab)`` float32): ids, and
    log-probabilities for the rows that asked for them (waits for the device)."""
    return choose(logits, rows).lists()

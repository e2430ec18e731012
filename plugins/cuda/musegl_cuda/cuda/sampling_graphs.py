"""The sampler of decode graph steps, captured as CUDA graphs per width.

A decode step of a captured width replays its forward graph
(:mod:`musegl_cuda.cuda.graphs`); when some row is not plain greedy (a grammar
mask, a penalty, ``logit_bias``, temperature/top-k/top-p/min-p, logprobs)
the rows are sampled by a second graph of the same width,
:func:`sample_static`, the chain of :mod:`musegl_cuda.sampling` written over
fixed-size inputs so that it needs no host value:

* per-row parameters (:class:`SamplerInputs`, twelve 32-bit words a row:
  temperature, top-p, min-p, the row's position-keyed uniform number, the
  three penalties, the logprobs temperature, top-k, greedy);
* ``logit_bias`` as (row, id, value) entries and the penalties as (row, id,
  generated count) entries, one per distinct id of the row's counted ids,
  in fixed-capacity lists whose unused entries point at a scratch row;
* the packed grammar bitmasks (uint32 words, unpacked on the device).

They are staged on the host into one of two pinned buffers (two steps may be
in flight) and sent with one copy per region in use: the parameters always,
the bias and penalty entries and the masks only when the step has some or
the device still holds an earlier step's. The masks are read after the
forward graph was launched (the engine's mask workers compute them while it
runs; :class:`~musegl_core.engine.masks.PendingMasks`).

Each width has up to six graphs, by :class:`SamplerVariant`: greedy rows only
(argmax after the processors), a draw without a sort (temperature, min-p),
a draw with one full sort per row (top-k, top-p), each with or without the
log-probabilities (the chosen id's and the :data:`TOP_LOGPROBS` most likely,
ties to the lowest id). The chosen ids go to the decode graphs' ``last_ids``
(rows that follow the step read them there) and, with the log-probabilities,
to pinned host buffers.

The results are the eager sampler's (:func:`musegl_cuda.sampling.choose`):
the same operations on the same values per row, and a row's values never
depend on the other rows. Steps the graphs cannot hold (a row asking for more
than :data:`TOP_LOGPROBS` alternatives, more bias or penalty entries than
the capacities, logits asked) are sampled eagerly from the graph's logits.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import attrs
import numpy as np
import torch

from musegl_core.engine.executor import HeadRows, Step, StepOutput, TokenLogprobs
from musegl_core.engine.sample_rows import SampleRows, bias_entries
from musegl_cuda.cuda.penalty_counts import PenaltyCounts
from musegl_cuda.pending import Launched
from musegl_cuda.sampling import NEG_INF, draw, top_logprobs

log = logging.getLogger("musegl.cuda")

#: alternatives the logprobs graphs report per row: the HTTP surfaces' cap (``top_logprobs`` <= 20)
TOP_LOGPROBS = 20
#: ``logit_bias`` entries a request may give (the HTTP surfaces' cap), times the rows
BIAS_PER_ROW = 300
#: penalty entries (distinct counted ids over the step's penalized rows) the graphs hold
PENALTY_ENTRIES = 1 << 17

# the words of a row's parameters: float32 ...
TEMPERATURE, TOP_P, MIN_P, UNIFORM, REPETITION, FREQUENCY, PRESENCE, LP_TEMPERATURE = range(8)
# ... then int32: top-k, greedy, the row's slot of the penalty counts (musegl_cuda.cuda.penalty_counts)
TOP_K, GREEDY, SLOT = 8, 9, 10
PARAM_WORDS = 12
ALL_ALLOWED = -1  # a mask word with every bit set, as int32


@attrs.frozen
class SamplerVariant:
    """Which parts of the chain a step needs: ``draw`` (some row is not greedy),
    ``sort`` (some such row has top-k or top-p), ``logprobs`` (some row asked)."""

    draw: bool = False
    sort: bool = False
    logprobs: bool = False

    @classmethod
    def of(cls, rows: SampleRows, vocab: int) -> "SamplerVariant":
        drawn = [p for p in rows.params if not p.greedy]
        return cls(bool(drawn), any(0 < p.top_k < vocab or p.top_p < 1.0 for p in drawn),
                   any(n >= 0 for n in rows.logprobs))

    @classmethod
    def every(cls) -> tuple["SamplerVariant", ...]:
        return tuple(cls(d, s, lp) for d, s in ((False, False), (True, False), (True, True)) for lp in (False, True))


class SamplerInputs:
    """The sampler graphs' inputs: device buffers read by every width, and their
    two pinned host twins (see the module docstring)."""

    def __init__(self, widest: int, vocab: int, device: torch.device, bias_entries_cap: int | None = None,
                 penalty_entries_cap: int = PENALTY_ENTRIES, zero_slot: int = 0) -> None:
        """``zero_slot``: the all-zero row of the penalty counts (what rows without a slot read)."""
        self.widest = widest
        self.zero_slot = zero_slot
        self.vocab = vocab
        self.words = -(-vocab // 32)
        self.bias_cap = widest * BIAS_PER_ROW if bias_entries_cap is None else bias_entries_cap
        self.penalty_cap = penalty_entries_cap
        # one int32 buffer: params (widest x 12) | bias (cap x 3) | penalties (cap x 3) | masks (widest x words)
        self._regions = {}
        at = 0
        for name, size in (("params", widest * PARAM_WORDS), ("bias", self.bias_cap * 3),
                           ("penalties", self.penalty_cap * 3), ("masks", widest * self.words)):
            self._regions[name] = (at, at + size)
            at += size
        self.device = device
        self._pinned = device.type == "cuda"
        self._device_buf = torch.zeros(at, dtype=torch.int32, device=device)
        self._host = [torch.zeros(at, dtype=torch.int32, pin_memory=self._pinned) for _ in range(2)]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # entries / mask rows on the device that may be other than padding (what the next staging must clear)
        self._bias_used = self._penalty_used = self._mask_rows = 0
        self.copies: list[str] = []  # the regions the last staging sent
        self.params = self._region(self._device_buf, "params").view(widest, PARAM_WORDS)
        self.bias = self._region(self._device_buf, "bias").view(self.bias_cap, 3)
        self.penalties = self._region(self._device_buf, "penalties").view(self.penalty_cap, 3)
        self.masks = self._region(self._device_buf, "masks").view(widest, self.words)
        for host in self._host:
            self._clear(host)
        self._device_buf.copy_(self._host[0])

    def _region(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        a, b = self._regions[name]
        return buf[a:b]

    def _clear(self, host: torch.Tensor) -> None:
        """Every row a padding row, every entry padding, every mask word all-allowed."""
        params = self._region(host, "params").view(self.widest, PARAM_WORDS).numpy()
        padding_params(params, self.zero_slot)
        for name in ("bias", "penalties"):
            entries = self._region(host, name).numpy().reshape(-1, 3)
            entries[:, 0] = -1
            entries[:, 1:] = 0
        self._region(host, "masks").numpy()[:] = ALL_ALLOWED

    def stage(self, rows: SampleRows, width: int, slots: Sequence[int | None] | None = None) -> bool:
        """Write ``rows`` (padded to ``width`` rows) into the next pinned buffer and queue
        its copies to the device; False (nothing written) when they exceed what the
        graphs hold (more rows than ``width``, a row asking for more than
        :data:`TOP_LOGPROBS` alternatives, more bias or penalty entries than the
        capacities): the caller samples them eagerly. ``slots``: each row's slot of
        the penalty counts on the device (None: its penalties go as entries)."""
        n = len(rows)
        if not n <= width <= self.widest or any(k > TOP_LOGPROBS for k in rows.logprobs):
            return False
        bias = bias_entries(rows, self.vocab)
        bias_count = 0 if bias is None else len(bias[0])
        slots = slots if slots is not None else [None] * n
        counted_here = [i for i in rows.penalized if slots[i] is None]
        pen = penalty_entries(rows, self.vocab, counted_here) if counted_here else None
        pen_count = 0 if pen is None else len(pen[0])
        if bias_count > self.bias_cap or pen_count > self.penalty_cap:
            return False
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the copies out of this buffer (two stagings ago) are done
            self._events[turn] = None
        host = self._host[turn]
        params = self._region(host, "params").view(self.widest, PARAM_WORDS).numpy()
        row_params(params[:n], rows, self.vocab)
        params[:n, SLOT] = [self.zero_slot if s is None else s for s in slots]
        padding_params(params[n:width], self.zero_slot)
        copies = [("params", 0, width * PARAM_WORDS)]
        self._bias_used = self._stage_entries(host, "bias", bias, bias_count, self._bias_used, copies)
        self._penalty_used = self._stage_entries(host, "penalties", pen, pen_count, self._penalty_used, copies)
        masks = self._region(host, "masks").numpy().reshape(self.widest, self.words)
        if any(m is not None for m in rows.masks):
            for i, m in enumerate(rows.masks):
                masks[i] = ALL_ALLOWED if m is None else np.asarray(m, dtype=np.uint32)[:self.words].view(np.int32)
            copies.append(("masks", 0, n * self.words))
            self._mask_rows = max(self._mask_rows, n)
        elif self._mask_rows:
            masks[:self._mask_rows] = ALL_ALLOWED
            copies.append(("masks", 0, self._mask_rows * self.words))
            self._mask_rows = 0
        for name, a, b in copies:
            base = self._regions[name][0]
            self._device_buf[base + a:base + b].copy_(host[base + a:base + b], non_blocking=True)
        if self._pinned:
            self._events[turn] = torch.cuda.Event()
            self._events[turn].record()
        self.copies = [name for name, _, _ in copies]
        return True

    def _stage_entries(self, host: torch.Tensor, name: str, columns, count: int, used: int,
                       copies: list) -> int:
        """Entries ``0..count`` from ``columns`` (row, id, value), ``count..used`` padding;
        returns how many the device holds now."""
        top = max(count, used)
        if not top:
            return 0
        entries = self._region(host, name).numpy().reshape(-1, 3)
        if count:
            r, c, v = columns
            entries[:count, 0] = r
            entries[:count, 1] = c
            entries[:count, 2] = np.asarray(v, dtype=np.float32).view(np.int32)
        entries[count:top, 0] = -1
        entries[count:top, 1:] = 0
        copies.append((name, 0, top * 3))
        return count


def padding_params(params: np.ndarray, zero_slot: int) -> None:
    """Padding rows: greedy, no filter, no penalty."""
    f = params[:, :8].view(np.float32)
    f[:] = (1.0, 1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0)
    params[:, TOP_K] = 0
    params[:, GREEDY] = 1
    params[:, SLOT] = zero_slot
    params[:, 11:] = 0


def row_params(params: np.ndarray, rows: SampleRows, vocab: int) -> None:
    """The words of each sampled row, as the eager sampler computes them (float32 of the
    same double values)."""
    ps = rows.params
    f = params[:, :8].view(np.float32)
    f[:, TEMPERATURE] = [max(p.temperature, 1e-6) for p in ps]
    f[:, TOP_P] = [p.top_p for p in ps]
    f[:, MIN_P] = [p.min_p for p in ps]
    f[:, UNIFORM] = rows.uniforms
    f[:, REPETITION] = [p.repetition_penalty for p in ps]
    f[:, FREQUENCY] = [p.frequency_penalty for p in ps]
    f[:, PRESENCE] = [p.presence_penalty for p in ps]
    f[:, LP_TEMPERATURE] = [p.temperature if not p.greedy else 1.0 for p in ps]
    params[:, TOP_K] = [p.top_k if 0 < p.top_k < vocab else 0 for p in ps]
    params[:, GREEDY] = [int(p.greedy) for p in ps]
    params[:, 11:] = 0


def penalty_entries(rows: SampleRows, vocab: int,
                    only: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, id, generated count) for every distinct counted id of every penalized row
    (``only`` those rows; prompt included; ids outside the vocabulary not counted): the
    nonzero part of :func:`musegl_core.engine.sample_rows.penalty_counts`."""
    rs, cs, vs = [], [], []
    for i in rows.penalized if only is None else only:
        ids, prompt_len = rows.counted[i]
        ids = np.asarray(ids, dtype=np.int64)
        inside = ids[(ids >= 0) & (ids < vocab)]
        generated = ids[prompt_len:]
        generated = generated[(generated >= 0) & (generated < vocab)]
        if len(ids) * 16 < vocab:  # a short history: sorting it beats counting over the vocabulary
            seen = np.unique(inside)
            counts = np.zeros(len(seen), dtype=np.float32)
            if len(generated):
                gen_ids, gen_counts = np.unique(generated, return_counts=True)
                counts[np.searchsorted(seen, gen_ids)] = gen_counts
        else:
            seen = np.flatnonzero(np.bincount(inside, minlength=vocab))
            counts = np.bincount(generated, minlength=vocab)[seen].astype(np.float32)
        rs.append(np.full(len(seen), i, dtype=np.int64))
        cs.append(seen)
        vs.append(counts)
    if not rs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.float32)
    return np.concatenate(rs), np.concatenate(cs), np.concatenate(vs)


@attrs.define
class SamplerOutputs:
    """Where a sampler graph leaves its answer: ``ids`` (the decode graphs' ``last_ids``)
    and ``logprobs``, ``(widest, 1 + 2·TOP_LOGPROBS)`` int32 words a row: the chosen
    id's log-probability (float32 bits), the top ids, their log-probabilities (bits)."""

    ids: torch.Tensor
    logprobs: torch.Tensor

    @classmethod
    def on(cls, ids: torch.Tensor) -> "SamplerOutputs":
        return cls(ids, torch.zeros(len(ids), 1 + 2 * TOP_LOGPROBS, dtype=torch.int32, device=ids.device))


def sample_static(logits: torch.Tensor, inputs: SamplerInputs, width: int, variant: SamplerVariant,
                  out: SamplerOutputs, counts: PenaltyCounts) -> None:
    """Sample rows ``0..width`` of ``logits`` (float32 ``(>= width, vocab)``) from the
    staged ``inputs`` into ``out``: the eager chain of :func:`musegl_cuda.sampling.choose`
    with no host value, so it can be captured (it runs eagerly too)."""
    vocab = inputs.vocab
    device = logits.device
    params = inputs.params[:width]
    f = params[:, :8].view(torch.float32)
    # 1. processors, on a copy with one scratch row (row ``width``) that padding entries write
    z = torch.empty(width + 1, vocab, dtype=torch.float32, device=device)
    z[:width].copy_(logits[:width])
    z[width].zero_()
    flat = z.view(-1)
    bias = inputs.bias
    rows = bias[:, 0].long()
    rows = torch.where(rows >= 0, rows, width)
    # one add per (row, id) (a row's bias names an id once); padding entries add 0 to the scratch row
    flat.index_add_(0, rows * vocab + bias[:, 1].long(), bias[:, 2].view(torch.float32))
    pen = inputs.penalties
    rows = pen[:, 0].long()
    rows = torch.where(rows >= 0, rows, width)
    at = rows * vocab + pen[:, 1].long()
    times = pen[:, 2].view(torch.float32)
    of_row = rows.clamp(max=width - 1)
    rep, freq, pres = f[:, REPETITION][of_row], f[:, FREQUENCY][of_row], f[:, PRESENCE][of_row]
    v = flat[at]
    v = torch.where(v > 0, v / rep, v * rep)
    v = v - times * freq - (times > 0).float() * pres
    flat.scatter_(0, at, v)  # distinct (row, id) entries; padding ones all write the scratch row's 0
    zz = z[:width]
    # rows with a slot: their counts on the device (the zero slot, every other row: no change)
    slot = params[:, SLOT].long()
    seen, generated = counts.seen[slot], counts.generated[slot]
    rep = f[:, REPETITION:REPETITION + 1]
    zz.copy_(torch.where(seen, torch.where(zz > 0, zz / rep, zz * rep), zz)
             - generated * f[:, FREQUENCY:FREQUENCY + 1] - (generated > 0).float() * f[:, PRESENCE:PRESENCE + 1])
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (inputs.masks[:width, :, None] >> shifts) & 1
    zz.masked_fill_(bits.view(width, -1)[:, :vocab] == 0, NEG_INF)
    # 2. greedy rows: argmax; others: temperature, top-k, top-p, min-p, the draw
    chosen = torch.argmax(zz, dim=-1)
    if variant.draw:
        zt = zz / f[:, TEMPERATURE:TEMPERATURE + 1]
        if variant.sort:
            ks = params[:, TOP_K].long()
            sorted_z, order = torch.sort(zt, dim=-1, descending=True, stable=True)
            kth = sorted_z.gather(1, (ks.clamp(min=1) - 1)[:, None])
            active = (ks > 0)[:, None]
            zt = zt.masked_fill(active & (zt < kth), NEG_INF)
            # the sorted row with top-k applied: entries below kth are a suffix of it
            sorted_z = sorted_z.masked_fill(active & (sorted_z < kth), NEG_INF)
            top_p = f[:, TOP_P:TOP_P + 1]
            probs = torch.softmax(sorted_z, dim=-1)
            mass_before = torch.cumsum(probs, dim=-1) - probs
            drop_sorted = (mass_before >= top_p) & (top_p < 1.0)
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            zt = zt.masked_fill(drop, NEG_INF)
        min_p = f[:, MIN_P:MIN_P + 1]
        probs = torch.softmax(zt, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_p
        zt = zt.masked_fill(probs < floor, NEG_INF)
        drawn = draw(zt, f[:, UNIFORM].clamp(0.0, 1.0 - 2**-24))
        chosen = torch.where(params[:, GREEDY] != 0, chosen, drawn)
    out.ids[:width].copy_(chosen)
    if variant.logprobs:
        lp = torch.log_softmax(zz / f[:, LP_TEMPERATURE:LP_TEMPERATURE + 1], dim=-1)
        picked = lp.gather(1, chosen[:, None])
        top_ids, top_values = top_logprobs(lp, TOP_LOGPROBS)
        words = out.logprobs[:width]
        words[:, :1].copy_(picked.view(torch.int32))
        words[:, 1:1 + TOP_LOGPROBS].copy_(top_ids)
        words[:, 1 + TOP_LOGPROBS:].copy_(top_values.view(torch.int32))


class SamplerGraphs:
    """One sampler graph per (width, :class:`SamplerVariant`) over a
    :class:`~musegl_cuda.cuda.graphs.DecodeGraphs`' logits (see the module docstring)."""

    def __init__(self, decode, vocab: int | None = None) -> None:
        """``vocab``: the logits' width (None: that of the captured decode graphs' logits)."""
        self.decode = decode
        if vocab is None:
            vocab = decode.logits[decode.widest].shape[-1]
        self.vocab = vocab
        device = decode.last_ids.device
        self.counts = PenaltyCounts(decode.widest, vocab, device)
        self.inputs = SamplerInputs(decode.widest, vocab, device, zero_slot=self.counts.zero)
        self.out = SamplerOutputs.on(decode.last_ids)
        self.graphs: dict[tuple[int, SamplerVariant], torch.cuda.CUDAGraph] = {}
        pinned = device.type == "cuda"
        self._ids_host = [torch.zeros(decode.widest, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._lp_host = [torch.zeros_like(self.out.logprobs, device="cpu", pin_memory=pinned) for _ in range(2)]
        self._turn = 0

    def capture(self, pool, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Capture every width and variant into ``pool`` (the decode graphs' pool); seconds."""
        start = time.perf_counter()
        variants = SamplerVariant.every()
        total = len(self.decode.sizes) * len(variants)
        done = 0
        with torch.inference_mode():
            for width in reversed(self.decode.sizes):
                for variant in variants:
                    if progress is not None:
                        progress(done, total, f"sampler graph width {width}")
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            self._run(width, variant)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    try:
                        with torch.cuda.graph(graph, pool=pool):
                            self._run(width, variant)
                    except RuntimeError as exc:  # that variant samples eagerly (the same chain, not captured)
                        log.warning("sampler graph width %d %s not captured: %s", width, variant, exc)
                    else:
                        self.graphs[(width, variant)] = graph
                    done += 1
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        log.info("captured %d sampler graphs in %.1f s", len(self.graphs), elapsed)
        return elapsed

    def _run(self, width: int, variant: SamplerVariant) -> None:
        sample_static(self.decode.logits[width], self.inputs, width, variant, self.out, self.counts)

    def release(self, seq: int) -> None:
        """The sequence ended: its penalty counts' slot is free."""
        self.counts.release(seq)

    def launch(self, step: Step, starts: Sequence[int], width: int, device_rows: dict[int, int] | None,
               hidden=None) -> "GraphSampled | None":
        """Sample the decode-only ``step`` whose forward graph of ``width`` was just
        replayed (``hidden``: its tapped rows, or None); None (nothing queued) when a
        graph cannot hold it."""
        if any(ch.want_logits or ch.logit_rows for ch in step.chunks):
            return None
        plan = HeadRows.of(step, starts)
        if plan.rows != list(range(len(plan.rows))) or plan.sampled != plan.rows:
            return None
        rows = SampleRows.of(step)  # reads the masks: computed while the forward graph runs
        slots = None
        if rows.penalized:  # one-row chunks count on the device, adding only their new ids
            single = [ch.seq if len(ch.tokens) == 1 else None for ch in step.chunks for _ in ch.sampled_rows]
            index = rows.penalized
            got = self.counts.assign([single[i] for i in index], [rows.counted[i] for i in index])
            slots = [None] * len(rows)
            for i, slot in zip(index, got):
                slots[i] = slot
        if not self.inputs.stage(rows, width, slots):
            return None
        variant = SamplerVariant.of(rows, self.vocab)
        graph = self.graphs.get((width, variant))
        if graph is not None:
            graph.replay()
        else:  # not captured (a CPU-built instance): the same chain, eagerly
            self._run(width, variant)
        n = len(rows)
        turn = self._turn
        self._turn ^= 1
        ids = self._ids_host[turn]
        ids[:n].copy_(self.out.ids[:n], non_blocking=True)
        lp = None
        if variant.logprobs:
            lp = self._lp_host[turn]
            lp[:n].copy_(self.out.logprobs[:n], non_blocking=True)
        event = None
        if ids.is_pinned():
            event = torch.cuda.Event()
            event.record()
        wanted = rows.wanted
        return GraphSampled(step, starts, plan, ids, lp, event, wanted, [rows.logprobs[i] for i in wanted],
                            device_rows, hidden, self.out.ids[:n])


class GraphSampled(Launched):
    """A step sampled by a sampler graph: its ids (and log-probabilities) in one of
    :class:`SamplerGraphs`' pinned buffer pairs, read after ``event``."""

    def __init__(self, step: Step, starts: Sequence[int], plan: HeadRows, ids: torch.Tensor,
                 lp: torch.Tensor | None, event, wanted: list[int], counts: list[int],
                 device_rows: dict[int, int] | None, hidden=None, device_ids: torch.Tensor | None = None) -> None:
        self.step, self.starts, self.plan = step, starts, plan
        self.ids, self.lp, self.event = ids, lp, event
        self.wanted, self.counts = wanted, counts
        self.device_rows = device_rows
        self.hidden = hidden
        # the drawn ids on the device in sampled-row order (``last_ids``: valid until the next replay),
        # for what judges drafts on the device right after the launch
        self.device_ids = device_ids
        self.ids_by_row = False

    def _read(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        n = len(self.plan.sampled)
        ids = self.ids[:n].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * n
        if self.wanted:
            words = self.lp.numpy()
            for i, count in zip(self.wanted, self.counts):
                row = words[i]
                picked = float(row[:1].view(np.float32)[0])
                top_ids = row[1:1 + count].tolist()
                top_values = row[1 + TOP_LOGPROBS:1 + TOP_LOGPROBS + count].view(np.float32).tolist()
                logprobs[i] = TokenLogprobs(picked, tuple(top_ids), tuple(top_values))
        return self.plan.output(self.step, self.starts, None, ids, logprobs, self.hidden)

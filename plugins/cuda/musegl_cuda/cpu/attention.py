"""Attention over the paged KV cache with each row computed from its own keys alone.

Stored mode on the CPU runs attention through ``mw_attention`` (the kernels of
:mod:`musegl_cuda.cpu.native`): for every activation row and query head, the row's
keys (its sequence's cache slots up to its position; a sliding layer only the last
``window``) in one fixed order, so a row's result is the same bits alone, beside
other sequences (whatever their lengths), beside a prompt chunk, or inside a prompt
chunked another way. torch's batched products round a row differently with the
padding and the number of rows beside it (measured: a decode row's logits moved in
the last bits when batch-mates of other lengths shared its step). Without the
kernels (or with a head size the vectors do not divide) :func:`_rows_in_torch`
computes each row alone with torch, on one thread: the same guarantee, slower.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from musegl_cuda.cpu import native
from musegl_cuda.cpu.fixed_blocks import torch_threads
from musegl_cuda.kv_fp8 import dequantize_rows

THREADS = torch.get_num_threads()


@attrs.frozen
class RowKeys:
    """Each row's key list: ``slots[offsets[r] : offsets[r] + counts[r]]`` are the cache
    slots of the keys row ``r`` sees in a full layer (positions ``0 .. counts[r] - 1``);
    a sliding layer takes the last ``window`` of them."""

    slots: torch.Tensor  # int64, every sequence's slot list concatenated
    offsets: torch.Tensor  # int64 (rows,)
    counts: torch.Tensor  # int64 (rows,)
    max_keys: int
    max_slot: int  # the largest slot any list names (checked against the cache before the kernel reads it)
    min_slot: int = 0

    @classmethod
    def of(cls, sequences: Sequence, rows: int) -> "RowKeys":
        """From a step's :class:`~musegl_cuda.model.SequenceAttention` list: each
        sequence's full slot list and its causal mask (row ``i`` sees keys ``0 .. p_i``)."""
        offsets = torch.zeros(rows, dtype=torch.long)
        counts = torch.ones(rows, dtype=torch.long)
        lists, start = [], 0
        for seq in sequences:
            lists.append(seq.full_slots.to(torch.long))
            offsets[seq.rows] = start
            counts[seq.rows] = seq.full_mask.sum(1).to(torch.long)
            start += int(seq.full_slots.shape[0])
        slots = torch.cat(lists) if lists else torch.zeros(1, dtype=torch.long)
        ends = offsets + counts
        if rows and (int(counts.min()) < 1 or int(ends.max()) > slots.shape[0]):
            raise ValueError("every attention row needs 1 .. len(its slot list) keys")
        return cls(slots.contiguous(), offsets, counts, int(counts.max()) if rows else 1, int(slots.max()),
                   int(slots.min()))


    @classmethod
    def of_decode(cls, tables: Sequence[Sequence[int]], last: Sequence[int], block_size: int) -> "RowKeys":
        """One row per sequence at position ``last[i]`` (a decode step), from each sequence's
        block table (its leading blocks, checked against the pool): row ``i`` reads the slots
        of positions ``0 .. last[i]``, in order, from its own run of the slot list (the tables
        padded with block 0 to the longest: slots no row reads)."""
        rows = len(tables)
        width = max(len(t) for t in tables)
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        slots = (table[:, :, None] * block_size + torch.arange(block_size)).reshape(-1)
        blocks = [b for t in tables for b in t]
        return cls(slots, torch.arange(0, rows * width * block_size, width * block_size),
                   torch.tensor([p + 1 for p in last], dtype=torch.long), max(last) + 1,
                   max(max(blocks), 0) * block_size + block_size - 1, min(min(blocks), 0) * block_size)


_last: tuple[object, RowKeys] | None = None  # the step whose row keys were built last (one per step)


def row_keys(batch) -> RowKeys:
    """:meth:`RowKeys.of` the step's sequences, built once per step (every layer asks)."""
    global _last
    if batch.keys is not None:  # a decode step's, built with its batch
        return batch.keys
    if _last is None or _last[0] is not batch:
        rows = int(batch.write_slots.shape[0])
        _last = (batch, RowKeys.of(batch.sequences, rows))
    return _last[1]


def attention_rows(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, batch, window: int,
                   scale: float, kernels: native.Kernels | None) -> torch.Tensor:
    """Softmax attention of ``q (rows, heads, hd)`` over each row's keys in the cache
    ``k_flat, v_flat (slots, kv_heads, hd)`` (float32) for a step's
    :class:`~musegl_cuda.model.AttentionBatch`; ``window`` > 0 for a sliding layer;
    ``kernels``: the build the layer's matrices run on (None: torch, one row at a time).
    Returns ``(rows, heads, hd)``."""
    return attend(q, k_flat, v_flat, row_keys(batch), window, scale, kernels)


_compact: tuple[object, RowKeys] | None = None  # the step whose compact row keys were built last


def dequantized_attention_rows(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, k_scale: torch.Tensor,
                               v_scale: torch.Tensor, batch, window: int, scale: float,
                               kernels: native.Kernels | None) -> torch.Tensor:
    """:func:`attention_rows` over an FP8 cache (``--kv-cache-dtype fp8``, the CPU reference):
    the keys the step's rows read are gathered and dequantized with the layer's per-head
    scales (:func:`musegl_cuda.kv_fp8.dequantize_rows`) into a float32 cache of their own,
    which the same kernels then read, each row from its own keys as before."""
    global _compact
    keys = row_keys(batch)
    if _compact is None or _compact[0] is not batch:
        n = int(keys.slots.shape[0])
        _compact = (batch, attrs.evolve(keys, slots=torch.arange(n, dtype=torch.long), max_slot=n - 1, min_slot=0))
    if keys.max_slot >= k_flat.shape[0] or keys.min_slot < 0:
        raise IndexError(f"attention keys outside the cache's {k_flat.shape[0]} slots")
    k = dequantize_rows(k_flat, keys.slots, k_scale, q.dtype).contiguous()
    v = dequantize_rows(v_flat, keys.slots, v_scale, q.dtype).contiguous()
    return attend(q, k, v, _compact[1], window, scale, kernels)


def attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, keys: RowKeys, window: int, scale: float,
           kernels: native.Kernels | None) -> torch.Tensor:
    """:func:`attention_rows` for rows whose keys ``keys`` gives, by ``kernels``, else
    (None, or a head size the vectors do not divide) one row at a time in torch."""
    rows, heads, hd = q.shape
    kvh = k_flat.shape[1]
    if keys.max_slot >= k_flat.shape[0] or keys.min_slot < 0:
        raise IndexError(f"attention keys outside the cache's {k_flat.shape[0]} slots")
    if (kernels is not None and hd % kernels.lanes == 0 and q.dtype == k_flat.dtype == v_flat.dtype == torch.float32
            and k_flat.is_contiguous() and v_flat.is_contiguous()):
        q = q.contiguous()
        out = torch.empty_like(q)
        failed = kernels.lib.mw_attention(q.data_ptr(), rows, heads, hd, k_flat.data_ptr(), v_flat.data_ptr(), kvh,
                                          keys.slots.data_ptr(), keys.offsets.data_ptr(), keys.counts.data_ptr(),
                                          window, keys.max_keys, scale, out.data_ptr(), THREADS)
        if not failed:
            return out
    return _rows_in_torch(q, k_flat, v_flat, keys, window, scale)


def _rows_in_torch(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, keys: RowKeys, window: int,
                   scale: float) -> torch.Tensor:
    """:func:`attention_rows` one row at a time with torch on one thread: every product's
    shape depends on the row's own key count alone, so the row's bits do too."""
    rows, heads, hd = q.shape
    kvh = k_flat.shape[1]
    group = heads // kvh
    out = torch.empty(rows, heads, hd, dtype=q.dtype)
    with torch_threads(1):
        for r in range(rows):
            count, offset = int(keys.counts[r]), int(keys.offsets[r])
            lo = max(0, count - window) if window > 0 else 0
            idx = keys.slots[offset + lo:offset + count]
            k = k_flat.index_select(0, idx).permute(1, 2, 0)  # (kvh, hd, n)
            v = v_flat.index_select(0, idx).permute(1, 0, 2)  # (kvh, n, hd)
            qr = q[r].reshape(kvh, group, hd).clone()
            probs = torch.softmax(torch.matmul(qr, k) * scale, dim=-1, dtype=torch.float32).to(q.dtype)
            out[r] = torch.matmul(probs, v).reshape(heads, hd)
    return out

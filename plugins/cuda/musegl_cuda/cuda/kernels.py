"""Triton kernels of the CUDA path (imported only when the executor runs on a GPU).

* :func:`paged_attention`: attention of packed query rows over the paged KV
  cache, for prefill and decode alike, GQA-packed (one program serves every
  query head of a KV head), with the sliding window, split over the keys
  (flash-decoding) so that a batch-1 decode still fills the GPU. It writes
  unnormalized partial results; :func:`combine_gate` merges the splits,
  normalizes and applies the attention output gate.
* :func:`qk_norm_rope_store`: the scale-less QK norm, ``×qk_scale``, RoPE and
  the K/V cache write of one layer in one launch.
* :func:`add_norm`: ``h + CenteredNorm(o)`` followed by the next
  ``CenteredNorm`` (the sandwich norms between the blocks), one launch.
* :func:`silu_mul`: ``silu(gate)·up`` of the fused gate/up projection.

Rounding follows the eager torch path (``musegl_cuda.model``): every value
the eager path materializes in the activation dtype is rounded to it here
too; reductions run in float32.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------
# attention


@triton.jit(do_not_specialize=["stride_table", "splits"])
def _paged_attention_kernel(
    Q, K, V, Acc, M, L, Tables, Tiles, QKVG, Out, Scales,
    stride_q_row, stride_q_head,
    stride_kv_slot, stride_kv_head,
    stride_table,
    stride_acc_split, stride_acc_row, stride_acc_head,
    stride_ml_split, stride_ml_row,
    stride_g_row, gate_offset, stride_out_row,
    scale, window, splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
    GATED: tl.constexpr, FP8: tl.constexpr, KV_HEADS: tl.constexpr,
):
    # ``splits`` follows the step's tile count (attention_splits) and ``stride_table`` the
    # step's widest block table: both are runtime values, not specialized, so that one compiled
    # kernel serves every step of a (BLOCK_M, SLIDING, GATED) kind. As a constexpr every new
    # split count compiled a kernel in the middle of serving (a mixed step of another width: a
    # second or more on the engine thread); warm_attention compiles the kinds at start-up.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(Tiles + tile * 4)
    row0 = tl.load(Tiles + tile * 4 + 1)
    nrows = tl.load(Tiles + tile * 4 + 2)
    pos0 = tl.load(Tiles + tile * 4 + 3)

    offs_m = tl.arange(0, BLOCK_M)
    r = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    valid_m = r < nrows
    pos_m = pos0 + r
    rows = (row0 + r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_q_row + head[:, None] * stride_q_head + offs_d[None, :],
                mask=valid_m[:, None], other=0.0)

    hi = pos0 + nrows  # keys lo .. hi-1
    lo = 0
    if SLIDING:
        lo = tl.maximum(pos0 - window + 1, 0)
    per = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(hi, start + per)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    score_scale = scale
    if FP8:  # e4m3 K/V: read as the query's dtype (exact), the head's scales applied in float32
        score_scale = scale * tl.load(Scales + kvh)
    table = Tables + seq.to(tl.int64) * stride_table
    for j0 in range(start, end, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        kmask = offs_n < end
        block = tl.load(table + offs_n // KV_BLOCK, mask=kmask, other=0)
        slot = block.to(tl.int64) * KV_BLOCK + offs_n % KV_BLOCK
        kv_off = slot[:, None] * stride_kv_slot + kvh * stride_kv_head + offs_d[None, :]
        k = tl.load(K + kv_off, mask=kmask[:, None], other=0.0)
        if FP8:
            k = k.to(Q.dtype.element_ty)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
        visible = kmask[None, :] & (offs_n[None, :] <= pos_m[:, None])
        if SLIDING:
            visible = visible & ((pos_m[:, None] - offs_n[None, :]) < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kmask[:, None], other=0.0)
        if FP8:
            v = v.to(Q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if FP8:  # the V scale is one number per head: applied once to the sum
        acc = acc * tl.load(Scales + KV_HEADS + kvh)

    if GATED:  # one split: normalize and gate here, as combine_gate would (same roundings)
        y = (acc / l_i[:, None]).to(Out.dtype.element_ty)
        _store_gated(y, QKVG, Out, rows, head, offs_d, valid_m, stride_g_row, gate_offset, stride_out_row, HEAD_DIM)
    else:
        acc_ptr = (Acc + split * stride_acc_split + rows[:, None] * stride_acc_row
                   + head[:, None] * stride_acc_head + offs_d[None, :])
        tl.store(acc_ptr, acc, mask=valid_m[:, None])
        ml = split * stride_ml_split + rows * stride_ml_row + head
        tl.store(M + ml, m_i, mask=valid_m)
        tl.store(L + ml, l_i, mask=valid_m)


@triton.jit
def _store_gated(y, QKVG, Out, rows, head, offs_d, valid_m, stride_g_row, gate_offset, stride_out_row,
                 HEAD_DIM: tl.constexpr):
    """``Out = y · sigmoid(gate)`` for the (row, head) vectors of ``y``, rounded as the eager path rounds."""
    dtype = Out.dtype.element_ty
    g = tl.load(QKVG + rows[:, None] * stride_g_row + gate_offset + head[:, None] * HEAD_DIM + offs_d[None, :],
                mask=valid_m[:, None], other=0.0).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(dtype)
    res = (y.to(tl.float32) * gate.to(tl.float32)).to(dtype)
    tl.store(Out + rows[:, None] * stride_out_row + head[:, None] * HEAD_DIM + offs_d[None, :], res,
             mask=valid_m[:, None])


@triton.jit(do_not_specialize=["splits"])
def _combine_gate_kernel(Acc, M, L, QKVG, Out,
                         stride_acc_split, stride_acc_row, stride_ml_split, stride_ml_row,
                         stride_g_row, gate_offset, stride_out_row, splits,
                         HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    # the splits in chunks of CHUNK, each loaded at once (a long global layer has up to
    # GLOBAL_SPLITS_MOST of them); masked splits weigh exactly 0, so the result does not
    # depend on CHUNK. ``splits`` is a runtime value (one compiled kernel for every count).
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.arange(0, CHUNK)
    ml = row * stride_ml_row + head
    m_max = tl.max(tl.load(M + offs_c * stride_ml_split + ml, mask=offs_c < splits, other=float("-inf")), 0)
    for s0 in range(CHUNK, splits, CHUNK):
        s = s0 + offs_c
        m_max = tl.maximum(m_max, tl.max(tl.load(M + s * stride_ml_split + ml, mask=s < splits,
                                                 other=float("-inf")), 0))
    total = 0.0
    out = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, splits, CHUNK):
        s = s0 + offs_c
        valid = s < splits
        w = tl.exp(tl.load(M + s * stride_ml_split + ml, mask=valid, other=float("-inf")) - m_max)
        total += tl.sum(w * tl.load(L + s * stride_ml_split + ml, mask=valid, other=0.0), 0)
        acc = tl.load(Acc + s[:, None] * stride_acc_split + row * stride_acc_row + head * HEAD_DIM + offs_d[None, :],
                      mask=valid[:, None], other=0.0)
        out += tl.sum(w[:, None] * acc, 0)
    y = (out / total).to(Out.dtype.element_ty)
    g = tl.load(QKVG + row * stride_g_row + gate_offset + head * HEAD_DIM + offs_d).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)
    res = (y.to(tl.float32) * gate.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + row * stride_out_row + head * HEAD_DIM + offs_d, res)


#: Attention programs per multiprocessor that :func:`attention_splits` aims for.
PROGRAMS_PER_SM = 2
#: Overrides of the attention kernel's launch (None: the defaults in :func:`_attention_launch`);
#: ``benchmarks/gpu_kernel_probe.py`` tries others.
ATTENTION_BLOCK_N: int | None = None
ATTENTION_WARPS: int | None = None
ATTENTION_STAGES: int | None = None


#: Most key splits of a sliding layer (its keys: at most the window) and of a global layer
#: (all the context's keys): a decode step of few rows at a long context reads most of its
#: keys in the global layers, and with few KV heads 16 splits left most multiprocessors idle
#: (30B shape, 2 KV heads, batch 1: 32 programs on 132 SMs).
SLIDING_SPLITS_MOST = 16
GLOBAL_SPLITS_MOST = 128
#: splits the merge loads at once
COMBINE_CHUNK = 16


def attention_splits(tiles: int, kv_heads: int, sm_count: int = 132, most: int = SLIDING_SPLITS_MOST) -> int:
    """How many key splits keep about :data:`PROGRAMS_PER_SM` programs per multiprocessor busy."""
    want = -(-int(PROGRAMS_PER_SM * sm_count) // max(1, tiles * kv_heads))
    return max(1, min(most, want))


def layer_splits(tiles: int, kv_heads: int, sm_count: int = 132) -> tuple[int, int]:
    """``(sliding, global)`` key splits of a step of ``tiles`` attention tiles: the same
    target of programs per multiprocessor, capped at :data:`SLIDING_SPLITS_MOST` and
    :data:`GLOBAL_SPLITS_MOST`. Splits past a row's keys read nothing (short contexts
    pay one empty program each); a function of the tile count only, so graphs and the
    dynamic path split alike."""
    return (attention_splits(tiles, kv_heads, sm_count, SLIDING_SPLITS_MOST),
            attention_splits(tiles, kv_heads, sm_count, GLOBAL_SPLITS_MOST))


#: Shared memory per block (bytes) from which prefill tiles (``block_m`` >= 128, bf16/fp16) load
#: 128 keys a block over 3 stages with 8 warps: on an H200 that brings the 52 layers of a
#: 4,096-token prompt from 30.4 to 27.8 ms (``benchmarks/gpu_prefill_attention.py``); the
#: buffers need ~200 KB, which Hopper has (227 KB) and smaller parts do not.
WIDE_PREFILL_SMEM = 200 * 1024


@functools.lru_cache(maxsize=None)
def _block_smem(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def _prefill_launch(q: torch.Tensor, block_m: int) -> tuple[int, int, int] | None:
    """``(block_n, warps, stages)`` of a wide prefill tile on a GPU with the memory for it; None: the defaults."""
    if block_m < 128 or q.dtype == torch.float32 or q.device.type != "cuda":
        return None
    return (128, 8, 3) if _block_smem(q.device.index or 0) >= WIDE_PREFILL_SMEM else None


def _attention_launch(q, k_cache, v_cache, kv_block, tables, tiles, num_tiles, splits, block_m, window, sliding,
                      scale, acc, m, l, gate, scales=None):
    rows, heads, hd = q.shape
    kv_heads = k_cache.shape[1]
    fp32 = q.dtype == torch.float32
    wide = _prefill_launch(q, block_m)
    block_n, warps, stages = wide or ((32 if fp32 else 64), (4 if block_m <= 64 else 8), 2)
    qkvg, gate_offset, out = gate if gate is not None else (q, 0, q)
    _paged_attention_kernel[(num_tiles, kv_heads, splits)](
        q, k_cache, v_cache, acc, m, l, tables, tiles, qkvg, out, scales if scales is not None else m,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1),
        qkvg.stride(0), gate_offset, out.stride(0),
        scale, window, splits,
        GROUP=heads // kv_heads, HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=ATTENTION_BLOCK_N or block_n,
        KV_BLOCK=kv_block, SLIDING=sliding, PRECISION="ieee" if fp32 else "tf32",
        GATED=gate is not None, FP8=scales is not None, KV_HEADS=kv_heads,
        num_warps=ATTENTION_WARPS or warps, num_stages=ATTENTION_STAGES or stages,
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_block: int,
                    tables: torch.Tensor, tiles: torch.Tensor, num_tiles: int, splits: int, block_m: int,
                    window: int, sliding: bool, scale: float,
                    scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Partial attention of ``q (rows, heads, hd)`` over the paged cache.

    ``k_cache``/``v_cache`` are ``(slots, kv_heads, hd)`` views of blocks of
    ``kv_block`` slots (float8 e4m3 with ``scales``, the layer's ``(2, kv_heads)``
    float32 K and V scales: ``--kv-cache-dtype fp8``, :mod:`musegl_cuda.kv_fp8`); ``tables``
    ``(seqs, cols)`` int32 block ids; ``tiles`` ``(>= num_tiles, 4)`` int32
    rows ``(seq, first row, rows, first position)``. Returns ``(acc, m, l)``
    per split, for :func:`combine_gate`.
    """
    rows, heads, hd = q.shape
    acc = torch.empty(splits, rows, heads, hd, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, rows, heads, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _attention_launch(q, k_cache, v_cache, kv_block, tables, tiles, num_tiles, splits, block_m, window, sliding,
                      scale, acc, m, l, None, scales)
    return acc, m, l


def gated_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_block: int,
                    tables: torch.Tensor, tiles: torch.Tensor, num_tiles: int, splits: int, block_m: int,
                    window: int, sliding: bool, scale: float, qkvg: torch.Tensor, gate_offset: int,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
    """The gated attention output ``(rows, heads·hd)`` in ``q``'s dtype: with one
    split, one launch (the kernel normalizes and gates what it computed); with
    more, :func:`paged_attention` then :func:`combine_gate`. Both give the
    same values for the same ``splits``. ``scales``: an FP8 cache's (:func:`paged_attention`)."""
    if splits > 1:
        acc, m, l = paged_attention(q, k_cache, v_cache, kv_block, tables, tiles, num_tiles, splits, block_m,
                                    window, sliding, scale, scales)
        return combine_gate(acc, m, l, qkvg, gate_offset, q.dtype)
    rows, heads, hd = q.shape
    out = torch.empty(rows, heads * hd, dtype=q.dtype, device=q.device)
    _attention_launch(q, k_cache, v_cache, kv_block, tables, tiles, num_tiles, 1, block_m, window, sliding, scale,
                      q, q, q, (qkvg, gate_offset, out), scales)
    return out


def warm_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_block: int, scratch_block: int, heads: int,
                   block_ms: Sequence[int], window: int, qkvg_width: int, gate_offset: int,
                   dtype: torch.dtype | None = None, scales: torch.Tensor | None = None) -> int:
    """Compile every kind of attention launch a step can make before serving: each
    ``block_m`` of ``block_ms`` (decode and prefill tiles), sliding and global, one split
    (normalized and gated in the kernel) and several (then merged by :func:`combine_gate`).
    ``splits`` and the block table's width are runtime values; the other row-count-dependent
    arguments (the partial results' strides, ``rows x heads``) keep their divisibility by 16
    when the query heads are a multiple of 16 (the 30B shape has 32), so then no mixed or
    prefill step compiles a kernel while requests wait. The launches read one key of ``scratch_block`` (the padding rows' block)
    and write only their own outputs. ``dtype``: the queries' (default: the cache's);
    ``scales``: an FP8 cache's. Returns how many launches ran."""
    hd, dtype, device = k_cache.shape[-1], dtype or k_cache.dtype, k_cache.device
    q = torch.zeros(1, heads, hd, dtype=dtype, device=device)
    qkvg = torch.zeros(1, qkvg_width, dtype=dtype, device=device)
    tables = torch.full((1, 1), scratch_block, dtype=torch.int32, device=device)
    tiles = torch.tensor([[0, 0, 1, 0]], dtype=torch.int32, device=device)
    launches = 0
    for block_m in sorted(set(block_ms)):
        for sliding in (False, True):
            for splits in (1, 2):
                gated_attention(q, k_cache, v_cache, kv_block, tables, tiles, 1, splits, block_m, window, sliding,
                                1.0, qkvg, gate_offset, scales)
                launches += 1
    return launches


def combine_gate(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor, qkvg: torch.Tensor, gate_offset: int,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Merge the splits, normalize, and multiply by ``sigmoid(gate)``: ``(rows, heads·hd)``."""
    splits, rows, heads, hd = acc.shape
    out = torch.empty(rows, heads * hd, dtype=out_dtype, device=acc.device)
    _combine_gate_kernel[(rows, heads)](
        acc, m, l, qkvg, out, acc.stride(0), acc.stride(1), m.stride(0), m.stride(1),
        qkvg.stride(0), gate_offset, out.stride(0), splits, HEADS=heads, HEAD_DIM=hd, CHUNK=COMBINE_CHUNK,
        num_warps=1,
    )
    return out


# ---------------------------------------------------------------------------
# QK norm + RoPE + cache write


@triton.jit
def _e4m3_bits(x):
    """float8 e4m3 codes (int32 0..255) of float32 ``x`` in [-448, 448], rounded to nearest
    even as ``torch.Tensor.to(torch.float8_e4m3fn)`` rounds: computed in integers, so that
    Triton's interpreter (whose float8 cast rounds wrongly) and a GPU write the same bytes."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFFF + ((bits >> 20) & 1)  # round the 23-bit mantissa to 3 bits (carries into the exponent)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)  # exponent bias 127 -> 7
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # below 2^-6: multiples of 2^-9, to nearest even
    code = tl.where(a < 0.015625, sub, normal)
    negative = x.to(tl.int32, bitcast=True) < 0  # the sign bit (so -0.0 stores 0x80, as torch's cast does)
    return tl.where(negative, code | 128, code)


@triton.jit
def _qk_norm_rope_store_kernel(QKVG, Cos, Sin, Slots, Qout, Kc, Vc, Scales,
                               stride_row, stride_cos, stride_q_row, stride_kv_slot,
                               eps, qk_scale,
                               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               ROPE: tl.constexpr, FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # 0..HEADS-1: q heads; then KV_HEADS k heads
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    rot = (offs + half) % HEAD_DIM
    base = QKVG + row * stride_row + h * HEAD_DIM
    # every load first, so that they are in flight together (the kernel is latency-bound at decode widths)
    x = tl.load(base + offs).to(tl.float32)
    xr = tl.load(base + rot).to(tl.float32)
    if ROPE:
        cos = tl.load(Cos + row * stride_cos + offs).to(tl.float32)
        sin = tl.load(Sin + row * stride_cos + offs).to(tl.float32)
    kvh = tl.maximum(h - HEADS, 0)  # query heads load the first V head too (unused; a cache hit)
    v = tl.load(QKVG + row * stride_row + (HEADS + KV_HEADS + kvh) * HEAD_DIM + offs)
    slot = tl.load(Slots + row).to(tl.int64)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
    dtype = Qout.dtype.element_ty
    n = (x * inv).to(dtype)
    nr = (xr * inv).to(dtype)
    if h < HEADS:
        n = (n.to(tl.float32) * qk_scale).to(dtype)
        nr = (nr.to(tl.float32) * qk_scale).to(dtype)
    if ROPE:
        rh = tl.where(offs < half, -nr.to(tl.float32), nr.to(tl.float32))
        a = (n.to(tl.float32) * cos).to(dtype)
        b = (rh * sin).to(dtype)
        n = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    if h < HEADS:
        tl.store(Qout + row * stride_q_row + h * HEAD_DIM + offs, n)
    elif FP8:  # Kc and Vc are the e4m3 cache's bytes: x / scale, saturated at ±448, rounded
        ks = tl.load(Scales + kvh)
        vs = tl.load(Scales + KV_HEADS + kvh)
        kq = tl.minimum(tl.maximum(n.to(tl.float32) / ks, -448.0), 448.0)
        vq = tl.minimum(tl.maximum(v.to(tl.float32) / vs, -448.0), 448.0)
        tl.store(Kc + slot * stride_kv_slot + kvh * HEAD_DIM + offs, _e4m3_bits(kq).to(tl.uint8))
        tl.store(Vc + slot * stride_kv_slot + kvh * HEAD_DIM + offs, _e4m3_bits(vq).to(tl.uint8))
    else:
        tl.store(Kc + slot * stride_kv_slot + kvh * HEAD_DIM + offs, n)
        tl.store(Vc + slot * stride_kv_slot + kvh * HEAD_DIM + offs, v)


def qk_norm_rope_store(qkvg: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                       eps: float, qk_scale: float, rope: bool, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Normed, scaled and rotated queries ``(rows, heads, hd)``; K and V written to ``slots``
    (quantized to e4m3 with ``scales``, the layer's ``(2, kv_heads)`` K and V scales, where the
    cache is float8: ``--kv-cache-dtype fp8``)."""
    rows = qkvg.shape[0]
    q = torch.empty(rows, heads, head_dim, dtype=qkvg.dtype, device=qkvg.device)
    fp8 = scales is not None
    if fp8:  # written as bytes (see _e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _qk_norm_rope_store_kernel[(rows, heads + kv_heads)](
        qkvg, cos, sin, slots, q, k_cache, v_cache, scales if fp8 else cos,
        qkvg.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), eps, qk_scale,
        HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, ROPE=rope, FP8=fp8, num_warps=1,
    )
    return q


# ---------------------------------------------------------------------------
# norms and the MLP activation


@triton.jit
def _add_norm_kernel(O, H, ScalePost, ScaleNext, Hout, Xout, N, eps_post, eps_next,
                     HAS_RES: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = Hout.dtype.element_ty
    # every load first, so that they are in flight together (the kernel is latency-bound at decode widths)
    hf = tl.load(H + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        o = tl.load(O + row * N + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(ScalePost + offs, mask=mask, other=0.0)
    if HAS_NEXT:
        w2 = tl.load(ScaleNext + offs, mask=mask, other=0.0)
    if HAS_RES:
        inv = 1.0 / tl.sqrt(tl.sum(o * o, 0) / N + eps_post)
        normed = (o * inv * w).to(dtype)
        h = (hf + normed.to(tl.float32)).to(dtype)
        tl.store(Hout + row * N + offs, h, mask=mask)
        hf = h.to(tl.float32)
    if HAS_NEXT:
        inv2 = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps_next)
        tl.store(Xout + row * N + offs, (hf * inv2 * w2).to(dtype), mask=mask)


#: Warps of :func:`add_norm` (None: 8 for rows of 4096+ elements, else 4); benchmarks try others.
ADD_NORM_WARPS: int | None = None


def add_norm(o: torch.Tensor | None, h: torch.Tensor, scale_post: torch.Tensor | None, eps_post: float,
             scale_next: torch.Tensor | None, eps_next: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``h' = h + CenteredNorm(o)`` (``o`` None: ``h' = h``) and ``CenteredNorm(h')`` with
    ``scale_next`` (None: not computed). Scales hold ``1+w`` in float32."""
    rows, n = h.shape
    if o is not None:  # the kernel reads row r of ``o`` at r * n: a transposed product
        o = o.contiguous()  # (Linear's small-batch CPU form, in the interpreter) is copied first
    h_out = torch.empty_like(h) if o is not None else h
    x = torch.empty_like(h) if scale_next is not None else None
    block = triton.next_power_of_2(n)
    _add_norm_kernel[(rows,)](
        o if o is not None else h, h, scale_post if scale_post is not None else h,
        scale_next if scale_next is not None else h, h_out, x if x is not None else h,
        n, eps_post, eps_next, HAS_RES=o is not None, HAS_NEXT=scale_next is not None, BLOCK=block,
        num_warps=ADD_NORM_WARPS or (8 if block >= 4096 else 4),
    )
    return h_out, x


@triton.jit
def _silu_mul_kernel(GU, Out, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    dtype = Out.dtype.element_ty
    g = tl.load(GU + row * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(Out + row * F + offs, (s.to(tl.float32) * u).to(dtype), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``silu(gu[:, :F]) · gu[:, F:]`` of the fused gate/up product ``(rows, 2F)``."""
    rows, two_f = gu.shape
    f = two_f // 2
    out = torch.empty(rows, f, dtype=gu.dtype, device=gu.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(f, block))](gu, out, f, BLOCK=block, num_warps=4)
    return out


# ---------------------------------------------------------------------------
# the head's softcap


@triton.jit
def _softcap_kernel(Z, Out, N, mult, cap, HAS_CAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = Z.dtype.element_ty
    z = (tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32) * mult).to(dtype).to(tl.float32)
    if HAS_CAP:
        t = (z / cap).to(dtype).to(tl.float32)
        e = tl.exp(2.0 * t)
        th = (1.0 - 2.0 / (e + 1.0)).to(dtype).to(tl.float32)
        z = (th * cap).to(dtype).to(tl.float32)
    tl.store(Out + offs, z, mask=mask)


def softcap_logits(z: torch.Tensor, mult: float, cap: float | None) -> torch.Tensor:
    """``tanh(z·mult / cap)·cap`` as float32 in one pass over the head's output
    (each intermediate rounded to ``z``'s dtype, as the eager chain rounds it)."""
    z = z.contiguous()
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    n = z.numel()
    block = 2048
    _softcap_kernel[(triton.cdiv(n, block),)](z, out, n, float(mult), float(cap or 1.0), HAS_CAP=cap is not None,
                                              BLOCK=block, num_warps=8)
    return out

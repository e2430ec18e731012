"""Skinny products for decode steps (1 to :data:`GEMV_ROWS` activation rows) from weights as
stored, without tensor cores (imported only where Triton runs).

At decode widths a product is bound by the bytes of its weights, so these kernels read
every stored byte once, in contiguous tiles (16-byte loads where the layout's alignment
allows), and decode them in registers with CUDA-core arithmetic: no dot-operand layout,
no shared-memory round trip. Each program owns ``block_n`` weight rows and every
activation row (a ``static_range`` over them, so a weight tile is decoded once for all
rows) and walks its part of the depth; ``split_k`` parts of the depth (None: enough
programs to fill the GPU, :func:`~musegl_cuda.cuda.quantized.depth_splits`) write float32
partial sums that one more launch adds.

* :func:`gguf_gemv`: GGUF ``Q4_K``/``Q5_K``/``Q6_K`` (one 256-value super-block of each row
  per step) and ``Q8_0``/``Q4_0`` (``blocks`` 32-value blocks per step). A super-block's
  values are taken as groups that share one scale (Q4_K/Q5_K: 4 chunks of 32 bytes, the
  low and high nibbles being sub-blocks ``2c`` and ``2c + 1``; Q6_K: 8 groups of 16), and
  the product is factored per group, ``sum(v·x) = scale·sum(q·x) − min·sum(x)``, so each
  value costs a nibble extraction, a conversion and one multiply-add; the per-group scales
  and mins are decoded once per group and row, the ``sum(x)`` once per group for all rows.
* :func:`fp8_gemv`: e4m3 bytes ``(block_n, block_k)`` per step, converted in registers;
  a row's scale multiplies its sum once (one scale per row) or each value (block scales).

The launch parameters live in :data:`GEMV_CONFIGS` (per stored format and row count),
so that ``benchmarks/gpu_quantized_products.py --gemv-sweep`` can time the alternatives on
a GPU and this table can follow the fastest. Nothing here synchronizes with the host and
every launch depends on tensor shapes only, so the products capture into CUDA graphs.
Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (``quantized_checks.check_gemv``).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from musegl_cuda.cuda.quantized import GGUF_LAYOUTS, _f16_at, _launch_split, depth_splits


@attrs.frozen
class GemvConfig:
    """One launch of a skinny product: ``block_n`` weight rows per program, ``blocks``
    (GGUF Q8_0/Q4_0: 32-value blocks per step; FP8: ``16 · blocks`` values per step; the
    K-quants always take one super-block), ``split_k`` parts of the depth (None: enough
    programs to fill the GPU) and ``num_warps``."""

    block_n: int = 8
    blocks: int = 8
    split_k: int | None = None
    num_warps: int = 4


#: Products of at most this many activation rows run these kernels (``MUSEGL_CUDA_GEMV_ROWS``
#: overrides it in :mod:`musegl_cuda.cuda.device_weights`; 0 turns them off).
GEMV_ROWS = 8

#: ``(format, rows) -> config`` for rows in 1..GEMV_ROWS, ``format`` a GGUF type or ``"fp8"``.
#: Not yet timed on a GPU. Chosen so that the float32 accumulator (activation rows x weight
#: rows x values of a step, summed only after the loop) takes 32-64 registers a thread and a
#: step is 1-4 KiB of weights (a Q4_K step of 16 rows is 16 x 128 quant bytes, loaded in
#: 16-byte vectors through a 3-stage ``cp.async`` pipeline); the 30B matrices then launch
#: 400-2,500 programs, split in depth up to 4 per multiprocessor.
#: ``gpu_quantized_products.py --gemv-sweep`` times every config of :func:`sweep_configs`
#: and prints the fastest per format and rows (``gemv_best``) for this table to follow.
GEMV_CONFIGS: dict[tuple[str, int], GemvConfig] = {}
for _rows in range(1, GEMV_ROWS + 1):
    _tile = 1 << (_rows - 1).bit_length()  # the activation rows a program holds
    # the float32 accumulator (rows x weight rows x step values) at 32-64 per thread
    GEMV_CONFIGS["fp8", _rows] = GemvConfig(block_n=max(2, 8 // _tile), blocks=32 if _tile <= 2 else 16)
    for _fmt in GGUF_LAYOUTS:
        GEMV_CONFIGS[_fmt, _rows] = GemvConfig(block_n=max(4, 16 // _tile), blocks=8)


def gemv_config(fmt: str, m: int) -> GemvConfig:
    return GEMV_CONFIGS.get((fmt, m)) or GEMV_CONFIGS[fmt, GEMV_ROWS]


def sweep_configs(fmt: str) -> list[GemvConfig]:
    """The configs the benchmark's ``--gemv-sweep`` times for ``fmt`` (the depth split left to
    :func:`~musegl_cuda.cuda.quantized.depth_splits`)."""
    blocks = (16, 32, 64) if fmt == "fp8" else (4, 8, 16) if fmt in ("q8_0", "q4_0") else (1,)
    return [GemvConfig(block_n=block_n, blocks=b, num_warps=warps)
            for block_n in (4, 8, 16) for b in blocks for warps in (4, 8)]


@triton.jit
def _accumulate(acc, X, stride_xm, M, v, col, g_ok, BLOCK_M: tl.constexpr):
    """``acc`` ``(BLOCK_M, BN, G, R)`` plus the decoded values ``v`` ``(BN, G, R)`` times every
    activation row's values at columns ``col`` ``(1, G, R)`` (``g_ok``: which groups exist);
    elementwise, so that the loop does no reduction (the sum is taken once, at the end)."""
    mrow = tl.arange(0, BLOCK_M)[:, None, None, None]
    x = tl.load(X + mrow * stride_xm + col[None], mask=(mrow < M) & g_ok[None], other=0.0).to(tl.float32)
    return acc + v[None] * x


@triton.jit
def _k4_scale_min_words(w1, w2, w3, j):
    """``get_scale_min_k4`` from the scale bytes held as words ``w1`` (bytes 0-3), ``w2``
    (4-7), ``w3`` (8-11): the 6-bit scale and min of sub-blocks ``j`` (0..7), as float32."""
    shift = 8 * (j % 4)
    a = (w1 >> shift) & 0xFF
    b = (w2 >> shift) & 0xFF
    c = (w3 >> shift) & 0xFF
    low = j < 4
    sc = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode_step(rows, it, n_ok, nblocks, QTYPE: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCKS: tl.constexpr):
    """Step ``it`` of the weight rows at ``rows`` (uint8 pointers ``(BN,)``, ``n_ok`` their
    mask): ``(v_lo, col_lo, v_hi, col_hi, ok)``, float32 value tiles ``(BN, G, R)`` and their
    columns ``(1, G, R)`` (Q8_0 has no high tile: the low one twice), ``ok`` which groups exist."""
    if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, [qh 32], qs 128
        head = rows[:, None] + it * BB  # (BN, 1)
        base = head[:, :, None]
        c2 = tl.arange(0, 4)[None, :]  # 64-value chunk
        c = c2[:, :, None]
        ll = tl.arange(0, 32)[None, None, :]
        hmask = n_ok[:, None]
        mask = hmask[:, :, None]
        # the 16-byte head as 4 little-endian words: d | dmin << 16, then the 12 scale bytes
        words = tl.load(head.to(tl.pointer_type(tl.int32)) + tl.arange(0, 4)[None, :], mask=hmask, other=0)
        w02, w13 = tl.split(tl.reshape(words, (BLOCK_N, 2, 2)))
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, None]
        sc_lo, m_lo = _k4_scale_min_words(w1[:, None], w2[:, None], w3[:, None], 2 * c2)
        sc_hi, m_hi = _k4_scale_min_words(w1[:, None], w2[:, None], w3[:, None], 2 * c2 + 1)
        if QTYPE == 12:
            byte = tl.load(base + 16 + 32 * c + ll, mask=mask, other=0).to(tl.int32)
            q_lo = byte & 0xF
            q_hi = byte >> 4
        else:
            byte = tl.load(base + 48 + 32 * c + ll, mask=mask, other=0).to(tl.int32)
            qh = tl.load(base + 16 + ll, mask=mask, other=0).to(tl.int32)
            q_lo = (byte & 0xF) | (((qh >> (2 * c)) & 1) << 4)
            q_hi = (byte >> 4) | (((qh >> (2 * c + 1)) & 1) << 4)
        col = it * 256 + 64 * c + ll
        ok = tl.full([1, 1, 1], 1, tl.int1)  # every column (a splat: loads stay vectors)
        v_lo = (d * sc_lo)[:, :, None] * q_lo.to(tl.float32) - (dmin * m_lo)[:, :, None]
        v_hi = (d * sc_hi)[:, :, None] * q_hi.to(tl.float32) - (dmin * m_hi)[:, :, None]
        col_lo = col
        col_hi = col + 32
    elif QTYPE == 14:  # Q6_K: ql 128, qh 64, 16 x int8 scales, d; 8 groups of 16 ql bytes
        head = rows[:, None] + it * BB
        base = head[:, :, None]
        g2 = tl.arange(0, 8)[None, :]
        g = g2[:, :, None]
        r = tl.arange(0, 16)[None, None, :]
        hmask = n_ok[:, None]
        mask = hmask[:, :, None]
        d = _f16_at(head + 208, hmask)
        s_at = head + 192 + 8 * (g2 // 4) + g2 % 4
        sc_lo = d * tl.load(s_at, mask=hmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = d * tl.load(s_at + 4, mask=hmask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        ql = tl.load(base + 16 * g + r, mask=mask, other=0).to(tl.int32)
        qh = tl.load(base + 128 + 32 * (g // 4) + 16 * (g % 2) + r, mask=mask, other=0).to(tl.int32)
        up = (g // 2) % 2
        q_lo = (ql & 0xF) | (((qh >> (2 * up)) & 3) << 4)
        q_hi = (ql >> 4) | (((qh >> (4 + 2 * up)) & 3) << 4)
        col = it * 256 + 128 * (g // 4) + 16 * (g % 4) + r
        ok = tl.full([1, 1, 1], 1, tl.int1)
        v_lo = sc_lo[:, :, None] * (q_lo - 32).to(tl.float32)
        v_hi = sc_hi[:, :, None] * (q_hi - 32).to(tl.float32)
        col_lo = col
        col_hi = col + 64
    else:  # Q8_0 / Q4_0: BLOCKS 32-value blocks of d + quants
        b2 = it * BLOCKS + tl.arange(0, BLOCKS)[None, :]
        b = b2[:, :, None]
        hmask = n_ok[:, None] & (b2 < nblocks)
        mask = hmask[:, :, None]
        head = rows[:, None] + b2 * BB
        d = _f16_at(head, hmask)
        if QTYPE == 8:
            r = tl.arange(0, 32)[None, None, :]
            q = tl.load(head[:, :, None] + 2 + r, mask=mask, other=0).to(tl.int8, bitcast=True)
            v_lo = d[:, :, None] * q.to(tl.float32)
            v_hi = v_lo
            col_lo = b * 32 + r
            col_hi = col_lo
            ok = b < nblocks
        else:
            r = tl.arange(0, 16)[None, None, :]
            byte = tl.load(head[:, :, None] + 2 + r, mask=mask, other=0).to(tl.int32)
            col = b * 32 + r
            v_lo = d[:, :, None] * ((byte & 0xF) - 8).to(tl.float32)
            v_hi = d[:, :, None] * ((byte >> 4) - 8).to(tl.float32)
            col_lo = col
            col_hi = col + 16
            ok = b < nblocks
    return v_lo, col_lo, v_hi, col_hi, ok


@triton.jit
def _gguf_gemv_kernel(X, W, Y, M, N, nblocks, per_split, stride_xm, stride_wn, stride_ym, stride_ys,
                      QTYPE: tl.constexpr, BB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCKS: tl.constexpr, G: tl.constexpr, R: tl.constexpr, STAGES: tl.constexpr = 3):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = W + offs_n.to(tl.int64) * stride_wn  # (BN,)
    acc = tl.zeros([BLOCK_M, BLOCK_N, G, R], tl.float32)
    steps = tl.cdiv(nblocks, BLOCKS)
    for it in tl.range(split * per_split, tl.minimum(steps, (split + 1) * per_split), num_stages=STAGES):
        v_lo, col_lo, v_hi, col_hi, ok = _decode_step(rows, it, n_ok, nblocks, QTYPE, BB, BLOCK_N, BLOCKS)
        acc = _accumulate(acc, X, stride_xm, M, v_lo, col_lo, ok, BLOCK_M)
        if QTYPE != 8:
            acc = _accumulate(acc, X, stride_xm, M, v_hi, col_hi, ok, BLOCK_M)
    total = tl.sum(tl.sum(acc, axis=3), axis=2)
    offs_m = tl.arange(0, BLOCK_M)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, total.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def _rows_tile(m: int) -> int:
    return 1 << (m - 1).bit_length()


def gguf_gemv(x: torch.Tensor, w: torch.Tensor, dtype: str, n: int, k: int, out: torch.Tensor | None = None,
              config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``(m, k)`` (m in 1..:data:`GEMV_ROWS`, contiguous rows) and the
    GGUF ``dtype`` matrix of ``n`` rows stored as ``w`` (uint8 ``(n, row_bytes)``)."""
    code, vb, bb, _ = GGUF_LAYOUTS[dtype]
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or gemv_config(dtype, m)
    blocks = 1 if vb == 256 else cfg.blocks
    nblocks = k // vb
    steps = triton.cdiv(nblocks, blocks)
    grid = (triton.cdiv(n, cfg.block_n),)
    splits = cfg.split_k if cfg.split_k is not None else depth_splits(1, grid[0], steps, x.device)
    return _launch_split(_gguf_gemv_kernel, grid, splits, steps, x, y, m, n, (x, w),
                         lambda per, sm, ss: (m, n, nblocks, per, x.stride(0), w.stride(0), sm, ss),
                         QTYPE=code, BB=bb, BLOCK_M=_rows_tile(m), BLOCK_N=cfg.block_n, BLOCKS=blocks,
                         G=_GROUPS[dtype] or blocks, R=_GROUP_VALUES[dtype], num_warps=cfg.num_warps)


@triton.jit
def _gguf_dequant_kernel(W, Out, N, nblocks, stride_wn, stride_on, QTYPE: tl.constexpr, BB: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr):
    pid_n = tl.program_id(0)
    it = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = W + offs_n.to(tl.int64) * stride_wn
    v_lo, col_lo, v_hi, col_hi, ok = _decode_step(rows, it, n_ok, nblocks, QTYPE, BB, BLOCK_N, BLOCKS)
    out = Out + offs_n[:, None, None].to(tl.int64) * stride_on
    mask = n_ok[:, None, None] & ok
    tl.store(out + col_lo, v_lo.to(Out.dtype.element_ty), mask=mask)
    if QTYPE != 8:
        tl.store(out + col_hi, v_hi.to(Out.dtype.element_ty), mask=mask)


def gguf_dequant(w: torch.Tensor, dtype: str, n: int, k: int, out_dtype: torch.dtype,
                 block_n: int = 16) -> torch.Tensor:
    """The ``n`` rows of the GGUF ``dtype`` matrix stored as ``w`` (uint8 ``(n, row_bytes)``, rows
    in order: a slab of a matrix is a row slice of its data), decoded to ``out_dtype`` ``(n, k)``
    with the GEMV's decoding (contiguous, pipelined-width loads; one program per ``block_n``
    rows and step): the scratch of wide products (``device_weights.SCRATCH_ROWS``)."""
    code, vb, bb, _ = GGUF_LAYOUTS[dtype]
    out = torch.empty(n, k, dtype=out_dtype, device=w.device)
    if n == 0:
        return out
    blocks = 1 if vb == 256 else 8
    nblocks = k // vb
    grid = (triton.cdiv(n, block_n), triton.cdiv(nblocks, blocks))
    _gguf_dequant_kernel[grid](w, out, n, nblocks, w.stride(0), out.stride(0), QTYPE=code, BB=bb, BLOCK_N=block_n,
                               BLOCKS=blocks, num_warps=4)
    return out


#: the value tile of one step: groups of one scale (None: ``blocks`` blocks) and their values
_GROUPS = {"q4_k": 4, "q5_k": 4, "q6_k": 8, "q8_0": None, "q4_0": None}
_GROUP_VALUES = {"q4_k": 32, "q5_k": 32, "q6_k": 16, "q8_0": 32, "q4_0": 16}


@triton.jit
def _fp8_gemv_kernel(X, W, S, Y, M, N, K, per_split, stride_xm, stride_wn, stride_ym, stride_ys, stride_sn,
                     SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROW_SCALE: tl.constexpr, STAGES: tl.constexpr = 3):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    n_ok = offs_n < N
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    srows = S + (offs_n // SBN).to(tl.int64) * stride_sn
    mrow = tl.arange(0, BLOCK_M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.range(split * per_split * BLOCK_K, tl.minimum(K, (split + 1) * per_split * BLOCK_K), BLOCK_K,
                       num_stages=STAGES):
        ks = k0 + offs_k
        k_ok = ks < K
        byte = tl.load(rows + ks, mask=n_ok[:, None] & k_ok, other=0)
        w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if not ROW_SCALE:
            w = w * tl.load(srows[:, None] + ks // SBK, mask=n_ok[:, None] & k_ok, other=0.0)
        x = tl.load(X + mrow * stride_xm + ks, mask=k_ok & (mrow < M), other=0.0).to(tl.float32)
        acc += w[None, :, :] * x[:, None, :]
    total = tl.sum(acc, axis=2)
    if ROW_SCALE:
        total = total * tl.load(srows, mask=n_ok, other=0.0)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, total.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
             out: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ W^T`` for ``x`` ``(m, k)`` (m in 1..:data:`GEMV_ROWS`) and the FP8 matrix stored as
    ``w`` (e4m3 bytes ``(n, k)``) with float32 ``scales`` over ``block`` = ``(bn, bk)``
    (as :func:`~musegl_cuda.cuda.quantized.fp8_matmul`)."""
    m, k = x.shape
    n = w.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or gemv_config("fp8", m)
    block_k = 16 * cfg.blocks
    steps = triton.cdiv(k, block_k)
    grid = (triton.cdiv(n, cfg.block_n),)
    splits = cfg.split_k if cfg.split_k is not None else depth_splits(1, grid[0], steps, x.device)
    row_scale = block[1] >= k  # one scale per row (or per bn rows) over the whole depth
    return _launch_split(_fp8_gemv_kernel, grid, splits, steps, x, y, m, n, (x, w.view(torch.uint8), scales),
                         lambda per, sm, ss: (m, n, k, per, x.stride(0), w.stride(0), sm, ss, scales.stride(0)),
                         SBN=block[0], SBK=block[1], BLOCK_M=_rows_tile(m), BLOCK_N=cfg.block_n, BLOCK_K=block_k,
                         ROW_SCALE=row_scale, num_warps=cfg.num_warps)

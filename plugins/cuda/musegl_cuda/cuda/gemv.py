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

from musegl_cuda.cuda.quantized import GGUF_LAYOUTS, _f16_at, _k4_scale_min, _launch_split, depth_splits


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
#: Not yet timed on a GPU. Chosen so that each of 128 threads loads whole 16-byte vectors of
#: weights (a Q4_K step of 16 rows is 16 x 128 quant bytes, an FP8 step of 8 rows x 512
#: values 4 KiB) and fewer rows per program for more activation rows (registers); the 30B
#: matrices then launch 400-2,500 programs, split in depth up to 4 per multiprocessor.
#: ``gpu_quantized_products.py --gemv-sweep`` times every config of :func:`sweep_configs`
#: and prints the fastest per format and rows (``gemv_best``) for this table to follow.
GEMV_CONFIGS: dict[tuple[str, int], GemvConfig] = {}
for _fmt in (*GGUF_LAYOUTS, "fp8"):
    for _rows in range(1, GEMV_ROWS + 1):
        _narrow = _rows <= 4
        if _fmt == "fp8":
            GEMV_CONFIGS[_fmt, _rows] = GemvConfig(block_n=8 if _narrow else 4, blocks=32)
        elif _fmt in ("q8_0", "q4_0"):
            GEMV_CONFIGS[_fmt, _rows] = GemvConfig(block_n=8 if _narrow else 4, blocks=16)
        else:
            GEMV_CONFIGS[_fmt, _rows] = GemvConfig(block_n=16 if _narrow else 8, blocks=1)


def gemv_config(fmt: str, m: int) -> GemvConfig:
    return GEMV_CONFIGS.get((fmt, m)) or GEMV_CONFIGS[fmt, GEMV_ROWS]


def sweep_configs(fmt: str) -> list[GemvConfig]:
    """The configs the benchmark's ``--gemv-sweep`` times for ``fmt`` (the depth split left to
    :func:`~musegl_cuda.cuda.quantized.depth_splits`)."""
    blocks = (16, 32, 64) if fmt == "fp8" else (4, 8, 16) if fmt in ("q8_0", "q4_0") else (1,)
    return [GemvConfig(block_n=block_n, blocks=b, num_warps=warps)
            for block_n in (2, 4, 8, 16) for b in blocks for warps in (2, 4, 8)]


@triton.jit
def _accumulate(acc, X, stride_xm, M, lo, sc, mn, col, g_ok, BLOCK_M: tl.constexpr, HAS_MIN: tl.constexpr):
    """``acc`` ``(BLOCK_M, BN)`` plus, for every activation row, ``sum_g(sc·sum_r(lo·x) − mn·sum_r(x))``
    over the value tile ``lo`` ``(BN, G, R)`` whose columns are ``col`` ``(1, G, R)``."""
    mrow = tl.arange(0, BLOCK_M)
    for mi in tl.static_range(BLOCK_M):
        m_ok = tl.full([1, 1, 1], mi, tl.int32) < M
        x = tl.load(X + mi * stride_xm + col, mask=g_ok & m_ok, other=0.0).to(tl.float32)
        part = tl.sum(sc * tl.sum(lo * x, axis=2), axis=1)
        if HAS_MIN:
            part -= tl.sum(mn * tl.sum(x, axis=2), axis=1)
        acc += tl.where(mrow[:, None] == mi, part[None, :], 0.0)
    return acc


@triton.jit
def _gguf_gemv_kernel(X, W, Y, M, N, nblocks, per_split, stride_xm, stride_wn, stride_ym, stride_ys,
                      QTYPE: tl.constexpr, BB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCKS: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = W + offs_n.to(tl.int64) * stride_wn  # (BN,)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    steps = tl.cdiv(nblocks, BLOCKS)
    for it in range(split * per_split, tl.minimum(steps, (split + 1) * per_split)):
        if QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, [qh 32], qs 128
            head = rows[:, None] + it * BB  # (BN, 1)
            base = head[:, :, None]
            c2 = tl.arange(0, 4)[None, :]  # 64-value chunk
            c = c2[:, :, None]
            ll = tl.arange(0, 32)[None, None, :]
            hmask = n_ok[:, None]
            mask = hmask[:, :, None]
            d = _f16_at(head, hmask)
            dmin = _f16_at(head + 2, hmask)
            sc_lo, m_lo = _k4_scale_min(head + 4, 2 * c2, hmask)
            sc_hi, m_hi = _k4_scale_min(head + 4, 2 * c2 + 1, hmask)
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
            ok = col >= 0
            acc = _accumulate(acc, X, stride_xm, M, q_lo.to(tl.float32), d * sc_lo, dmin * m_lo, col, ok,
                              BLOCK_M, True)
            acc = _accumulate(acc, X, stride_xm, M, q_hi.to(tl.float32), d * sc_hi, dmin * m_hi, col + 32, ok,
                              BLOCK_M, True)
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
            ok = col >= 0
            acc = _accumulate(acc, X, stride_xm, M, q_lo.to(tl.float32), sc_lo, 32.0 * sc_lo, col, ok,
                              BLOCK_M, True)
            acc = _accumulate(acc, X, stride_xm, M, q_hi.to(tl.float32), sc_hi, 32.0 * sc_hi, col + 64, ok,
                              BLOCK_M, True)
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
                acc = _accumulate(acc, X, stride_xm, M, q.to(tl.float32), d, d, b * 32 + r, b < nblocks,
                                  BLOCK_M, False)
            else:
                r = tl.arange(0, 16)[None, None, :]
                byte = tl.load(head[:, :, None] + 2 + r, mask=mask, other=0).to(tl.int32)
                col = b * 32 + r
                acc = _accumulate(acc, X, stride_xm, M, (byte & 0xF).to(tl.float32), d, 8.0 * d, col,
                                  b < nblocks, BLOCK_M, True)
                acc = _accumulate(acc, X, stride_xm, M, (byte >> 4).to(tl.float32), d, 8.0 * d, col + 16,
                                  b < nblocks, BLOCK_M, True)
    offs_m = tl.arange(0, BLOCK_M)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


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
                         num_warps=cfg.num_warps)


@triton.jit
def _fp8_gemv_kernel(X, W, S, Y, M, N, K, per_split, stride_xm, stride_wn, stride_ym, stride_ys, stride_sn,
                     SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ROW_SCALE: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    n_ok = offs_n < N
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    srows = S + (offs_n // SBN).to(tl.int64) * stride_sn
    mrow = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(split * per_split * BLOCK_K, tl.minimum(K, (split + 1) * per_split * BLOCK_K), BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        byte = tl.load(rows + ks, mask=n_ok[:, None] & k_ok, other=0)
        w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if not ROW_SCALE:
            w = w * tl.load(srows[:, None] + ks // SBK, mask=n_ok[:, None] & k_ok, other=0.0)
        for mi in tl.static_range(BLOCK_M):
            m_ok = tl.full([1, 1], mi, tl.int32) < M
            x = tl.load(X + mi * stride_xm + ks, mask=k_ok & m_ok, other=0.0).to(tl.float32)
            acc += tl.where(mrow[:, None] == mi, tl.sum(w * x, axis=1)[None, :], 0.0)
    if ROW_SCALE:
        acc = acc * tl.load(srows, mask=n_ok, other=0.0)[None, :]
    offs_m = tl.arange(0, BLOCK_M)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=(offs_m[:, None] < M) & n_ok[None, :])


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

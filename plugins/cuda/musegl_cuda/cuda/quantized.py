"""Triton kernels that read quantized weights as stored (imported only where Triton runs).

GGUF blocks (``Q8_0``, ``Q4_0``, ``Q4_K``, ``Q5_K``, ``Q6_K``) are kept as the
file stores them: a ``uint8`` tensor ``(rows, row_bytes)``, the ggml blocks of
each row in file order (:mod:`musegl_core.checkpoint.stored`). FP8 weights are
``e4m3`` bytes ``(rows, cols)`` with float32 scales over ``(bn, bk)`` blocks of
the matrix (``W[i, j] = q[i, j] · s[i // bn, j // bk]``: one scale for the whole
matrix, one per output row, or one per 128 x 128 block).

* :func:`gguf_matmul` / :func:`fp8_matmul`: ``x @ W^T``. Each program owns
  ``BLOCK_M`` activation rows and ``BLOCK_N`` weight rows and walks the depth;
  every step decodes a tile of weight bytes in registers and feeds it, in the
  activation dtype, to ``tl.dot`` with float32 accumulation. Decode steps (few
  rows) run one program per ``BLOCK_N`` weight rows covering every activation
  row, so each weight byte is read once, and products of up to 16 rows split the
  depth (:func:`depth_splits`) so that a matrix of few rows still fills the GPU;
  prefill chunks run ``BLOCK_M = 64`` row tiles, the dequantized tile feeding the
  tensor cores.
* :func:`gguf_rows`: the embedding: rows gathered by token id and decoded.

The nibble formats are not decoded into file order: a tile of ``P`` byte
positions gives two value tiles (low and high nibbles), and the *activations*
are gathered in the order those values have (a product's terms may be summed
in any order). Nothing here synchronizes with the host and every launch has the
shapes of its tensors only, so the products run inside CUDA graphs like
``F.linear``. Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU
(the tests check them there against gguf-py's dequantizers).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from musegl_cuda.cuda.kernels import _e4m3_bits

# stored dtype tag -> (type code, values per block, bytes per block, byte positions per block)
GGUF_LAYOUTS = {
    "q8_0": (8, 32, 34, 32),
    "q4_0": (2, 32, 18, 16),
    "q4_k": (12, 256, 144, 128),
    "q5_k": (13, 256, 176, 128),
    "q6_k": (14, 256, 210, 128),
}
#: byte positions one step of the depth loop decodes (per weight row)
POSITIONS = 128


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian float16 at ``ptr`` (a uint8 pointer tensor), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min(scales, j, mask):
    """``get_scale_min_k4``: the 6-bit scale and min of sub-block ``j`` (0..7) of a Q4_K/Q5_K block."""
    s_j = tl.load(scales + j, mask=mask, other=0).to(tl.int32)
    s_j4 = tl.load(scales + j + 4, mask=mask, other=0).to(tl.int32)
    s_jm4 = tl.load(scales + tl.maximum(j - 4, 0), mask=mask, other=0).to(tl.int32)
    low = j < 4
    sc = tl.where(low, s_j & 63, (s_j4 & 0xF) | ((s_jm4 >> 6) << 4))
    mn = tl.where(low, s_j4 & 63, (s_j4 >> 4) | ((s_j >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode_gguf(rows, it, n_ok, nblocks, QTYPE: tl.constexpr, VB: tl.constexpr, BB: tl.constexpr,
                 PB: tl.constexpr, P: tl.constexpr, BN: tl.constexpr):
    """Decode step ``it`` of weight rows ``rows`` (uint8 pointers ``(BN, 1)``, ``n_ok`` their
    mask): float32 tiles ``(BN, P)`` of low and high values, their columns ``(1, P)`` (the
    high tile is unused for Q8_0) and the columns' mask. The ``P`` byte positions are taken
    as ``P / 16`` groups of 16 (3-D tiles): every scale, minimum and ``d`` is constant over
    a group, so it is loaded once per group and row, not once per value."""
    NG: tl.constexpr = P // 16
    j = tl.arange(0, NG)[None, :, None]
    r = tl.arange(0, 16)[None, None, :]
    start = (j * 16) % PB  # the group's first byte position in its block
    b = it * (P // PB) + (j * 16) // PB  # the group's block
    b_ok = b < nblocks
    mask = n_ok[:, :, None] & b_ok  # (BN, NG, 1)
    base = rows[:, :, None] + b.to(tl.int64) * BB
    t = start + r
    if QTYPE == 8:  # Q8_0: d, 32 x int8
        d = _f16_at(base, mask)
        q = tl.load(base + 2 + t, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        lo = d * q
        hi = lo
        col_lo = b * VB + t
        col_hi = col_lo
    elif QTYPE == 2:  # Q4_0: d, 16 bytes of two nibbles (values t and t + 16), offset 8
        d = _f16_at(base, mask)
        byte = tl.load(base + 2 + t, mask=mask, other=0).to(tl.int32)
        lo = d * ((byte & 0xF) - 8).to(tl.float32)
        hi = d * ((byte >> 4) - 8).to(tl.float32)
        col_lo = b * VB + t
        col_hi = col_lo + 16
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, [qh 32], qs 128
        d = _f16_at(base, mask)
        dmin = _f16_at(base + 2, mask)
        c = start // 32  # 64-value chunk: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        ll = t % 32
        sc_lo, m_lo = _k4_scale_min(base + 4, 2 * c, mask)
        sc_hi, m_hi = _k4_scale_min(base + 4, 2 * c + 1, mask)
        if QTYPE == 12:
            byte = tl.load(base + 16 + t, mask=mask, other=0).to(tl.int32)
            q_lo = byte & 0xF
            q_hi = byte >> 4
        else:
            byte = tl.load(base + 48 + t, mask=mask, other=0).to(tl.int32)
            qh = tl.load(base + 16 + ll, mask=mask, other=0).to(tl.int32)
            q_lo = (byte & 0xF) | (((qh >> (2 * c)) & 1) << 4)
            q_hi = (byte >> 4) | (((qh >> (2 * c + 1)) & 1) << 4)
        lo = (d * sc_lo) * q_lo.to(tl.float32) - dmin * m_lo
        hi = (d * sc_hi) * q_hi.to(tl.float32) - dmin * m_hi
        col_lo = b * VB + 64 * c + ll
        col_hi = col_lo + 32
    else:  # Q6_K: ql 128, qh 64, 16 x int8 scales, d
        h = start // 64  # 128-value half
        up = (start % 64) // 32  # second 32 bytes of the half's ql
        ll = t % 32
        s_lo = base + 192 + 8 * h + (start % 32) // 16 + 2 * up
        sc_lo = tl.load(s_lo, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        sc_hi = tl.load(s_lo + 4, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16_at(base + 208, mask)
        byte = tl.load(base + t, mask=mask, other=0).to(tl.int32)
        qh = tl.load(base + 128 + 32 * h + ll, mask=mask, other=0).to(tl.int32)
        q_lo = ((byte & 0xF) | (((qh >> (2 * up)) & 3) << 4)) - 32
        q_hi = ((byte >> 4) | (((qh >> (4 + 2 * up)) & 3) << 4)) - 32
        lo = (d * sc_lo) * q_lo.to(tl.float32)
        hi = (d * sc_hi) * q_hi.to(tl.float32)
        col_lo = b * VB + 128 * h + (t % 64)
        col_hi = col_lo + 64
    col_ok = tl.reshape(tl.broadcast_to(b_ok, (1, NG, 16)), (1, P))
    lo = tl.reshape(tl.broadcast_to(lo, (BN, NG, 16)), (BN, P))
    hi = tl.reshape(tl.broadcast_to(hi, (BN, NG, 16)), (BN, P))
    col_lo = tl.reshape(tl.broadcast_to(col_lo, (1, NG, 16)), (1, P))
    col_hi = tl.reshape(tl.broadcast_to(col_hi, (1, NG, 16)), (1, P))
    return lo, hi, col_lo, col_hi, col_ok


@triton.jit
def _gguf_matmul_kernel(X, W, Y, M, N, nblocks, per_split, stride_xm, stride_wn, stride_ym, stride_ys,
                        QTYPE: tl.constexpr, VB: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr,
                        P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    xrows = X + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    steps = tl.cdiv(nblocks, P // PB)
    for it in range(split * per_split, tl.minimum(steps, (split + 1) * per_split)):
        lo, hi, col_lo, col_hi, b_ok = _decode_gguf(rows, it, n_ok, nblocks, QTYPE, VB, BB, PB, P, BLOCK_N)
        x_lo = tl.load(xrows + col_lo, mask=m_ok & b_ok, other=0.0)
        acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=PRECISION)
        if QTYPE != 8:
            x_hi = tl.load(xrows + col_hi, mask=m_ok & b_ok, other=0.0)
            acc += tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), input_precision=PRECISION)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


@triton.jit
def _gguf_rows_kernel(Ids, W, Out, T, nblocks, stride_wn, stride_out,
                      QTYPE: tl.constexpr, VB: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr,
                      P: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_t = tl.program_id(0)
    it = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t[:, None] < T
    ids = tl.load(Ids + offs_t, mask=offs_t < T, other=0).to(tl.int64)
    rows = W + ids[:, None] * stride_wn
    lo, hi, col_lo, col_hi, b_ok = _decode_gguf(rows, it, t_ok, nblocks, QTYPE, VB, BB, PB, P, BLOCK_T)
    out = Out + offs_t[:, None].to(tl.int64) * stride_out
    tl.store(out + col_lo, lo.to(Out.dtype.element_ty), mask=t_ok & b_ok)
    if QTYPE != 8:
        tl.store(out + col_hi, hi.to(Out.dtype.element_ty), mask=t_ok & b_ok)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def product_tiles(m: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, warps)`` of a product of ``m`` activation rows: up to 64 rows
    one program covers them all (decode: every weight byte read once), more rows run
    64-row tiles (prefill)."""
    if m <= 16:
        return 16, 32, 4
    if m <= 32:
        return 32, 32, 4
    return 64, 64, 4


#: Decode products split the depth until the launch has about this many programs per
#: multiprocessor (each split writes float32 partial sums, added by one more small launch).
PROGRAMS_PER_SM = 4
#: Products of more rows than this never split the depth.
SPLIT_ROWS = 16


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def depth_splits(m: int, tiles: int, steps: int, device: torch.device) -> int:
    """How many parts a product of ``m`` rows with ``tiles`` programs and ``steps`` depth
    steps runs its depth in: 1 for wide products and on the CPU; else enough for
    :data:`PROGRAMS_PER_SM` programs per multiprocessor, at most one per step."""
    if m > SPLIT_ROWS or device.type != "cuda":
        return 1
    return max(1, min(steps, -(-PROGRAMS_PER_SM * _sm_count(device) // tiles)))


def _launch_split(kernel, grid2, splits: int, steps: int, x: torch.Tensor, y: torch.Tensor, m: int, n: int,
                  args_before, args_after, **meta) -> torch.Tensor:
    """Launch ``kernel`` over ``grid2`` x ``splits``; with several splits the float32 partial
    sums ``(splits, m, n)`` are added into ``y``."""
    per = -(-steps // splits)
    splits = -(-steps // per)  # no empty split
    if splits == 1:
        kernel[grid2 + (1,)](*args_before, y, *args_after(per, y.stride(0), 0), **meta)
        return y
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    kernel[grid2 + (splits,)](*args_before, part, *args_after(per, part.stride(1), part.stride(0)), **meta)
    return torch.sum(part, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(part.sum(0))


def gguf_matmul(x: torch.Tensor, w: torch.Tensor, dtype: str, n: int, k: int,
                out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``x @ W^T`` for activations ``x`` ``(m, k)`` (contiguous rows) and the GGUF ``dtype``
    matrix ``W`` of ``n`` rows stored as ``w`` (uint8 ``(n, row_bytes)``); ``(m, n)`` in
    ``x.dtype``. ``splits``: parts of the depth (None: :func:`depth_splits`)."""
    code, vb, bb, pb = GGUF_LAYOUTS[dtype]
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, warps = product_tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    p = max(pb, POSITIONS)
    nblocks = k // vb
    steps = triton.cdiv(nblocks, p // pb)
    if splits is None:
        splits = depth_splits(m, grid[0] * grid[1], steps, x.device)
    return _launch_split(_gguf_matmul_kernel, grid, splits, steps, x, y, m, n, (x, w),
                         lambda per, sm, ss: (m, n, nblocks, per, x.stride(0), w.stride(0), sm, ss),
                         QTYPE=code, VB=vb, BB=bb, PB=pb, P=p, BLOCK_M=block_m, BLOCK_N=block_n,
                         PRECISION=_precision(x.dtype), num_warps=warps)


def gguf_rows(ids: torch.Tensor, w: torch.Tensor, dtype: str, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64, 1-D) of the GGUF ``dtype`` matrix stored as ``w``, decoded to
    ``out_dtype`` ``(len(ids), k)``."""
    code, vb, bb, pb = GGUF_LAYOUTS[dtype]
    t = ids.shape[0]
    out = torch.empty(t, k, dtype=out_dtype, device=w.device)
    if t == 0:
        return out
    p = max(pb, POSITIONS)
    nblocks = k // vb
    block_t = 16
    grid = (triton.cdiv(t, block_t), triton.cdiv(nblocks, p // pb))
    _gguf_rows_kernel[grid](ids, w, out, t, nblocks, w.stride(0), out.stride(0),
                            QTYPE=code, VB=vb, BB=bb, PB=pb, P=p, BLOCK_T=block_t, num_warps=4)
    return out


# ---------------------------------------------------------------------------
# FP8 (e4m3) weights with block scales


@triton.jit
def _e4m3(byte):
    """float8 e4m3fn bits (int32 0..255) as float32 / 256: the bits shifted into a
    float16's sign, exponent and mantissa are the value times 2^-8, normal and
    subnormal alike (the bias of 15 against 7); the 2^8 goes into the scale. Exact in
    bfloat16 too (3 mantissa bits), so a tile whose rows have one scale each feeds the
    tensor cores unscaled and scales the tile's product in float32."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_matmul_kernel(X, W, S, Y, M, N, K, per_split, stride_xm, stride_wn, stride_ym, stride_ys, stride_sn,
                       SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, TILE_SCALE: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n[:, None] < N
    rows = W + offs_n[:, None].to(tl.int64) * stride_wn
    srows = S + (offs_n // SBN).to(tl.int64) * stride_sn
    xrows = X + offs_m[:, None].to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(split * per_split * BLOCK_K, tl.minimum(K, (split + 1) * per_split * BLOCK_K), BLOCK_K):
        ks = k0 + offs_k[None, :]
        k_ok = ks < K
        byte = tl.load(rows + ks, mask=n_ok & k_ok, other=0).to(tl.int32)
        x = tl.load(xrows + ks, mask=m_ok & k_ok, other=0.0)
        if TILE_SCALE:  # one scale per row over the whole tile: applied to the tile's product
            scale = tl.load(srows + k0 // SBK, mask=offs_n < N, other=0.0) * 256.0
            acc += tl.dot(x, tl.trans(_e4m3(byte).to(x.dtype)), input_precision=PRECISION) * scale[None, :]
        else:
            scale = tl.load(srows[:, None] + ks // SBK, mask=n_ok & k_ok, other=0.0)
            w = _e4m3(byte) * (scale * 256.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    out = Y + split.to(tl.int64) * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=m_ok & (offs_n[None, :] < N))


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
               out: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """``x @ W^T`` for the FP8 matrix ``W`` stored as ``w`` (e4m3 bytes ``(n, k)``, any
    8-bit dtype) and float32 ``scales`` ``(ceil(n/bn), ceil(k/bk))`` over ``block`` =
    ``(bn, bk)``; ``(m, n)`` in ``x.dtype``. ``splits``: parts of the depth (None:
    :func:`depth_splits`)."""
    m, k = x.shape
    n = w.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, warps = product_tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    block_k = 128
    steps = triton.cdiv(k, block_k)
    if splits is None:
        splits = depth_splits(m, grid[0] * grid[1], steps, x.device)
    return _launch_split(_fp8_matmul_kernel, grid, splits, steps, x, y, m, n, (x, w.view(torch.uint8), scales),
                         lambda per, sm, ss: (m, n, k, per, x.stride(0), w.stride(0), sm, ss, scales.stride(0)),
                         SBN=block[0], SBK=block[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         TILE_SCALE=block[1] % block_k == 0 or block[1] >= k, PRECISION=_precision(x.dtype),
                         num_warps=warps)


# ---------------------------------------------------------------------------
# W8A8: activations quantized per row to e4m3


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_xm, stride_qm, E4M3_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), E4M3_MAX), 1e-12)  # IEEE division, as torch's
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + offs < K
        x = tl.load(X + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -E4M3_MAX), E4M3_MAX)
        tl.store(Q + row * stride_qm + k0 + offs, _e4m3_bits(q).to(tl.uint8), mask=ok)


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 (m, k), float32 scales (m, 1))`` of ``x`` quantized per row with scale
    ``max(amax / 448, 1e-12)``, rounded to nearest even: the bytes of
    ``(x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``, in one launch (a
    program per row, reading the row twice: once for its maximum, once to quantize it)."""
    from musegl_cuda.quantization import E4M3_MAX

    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), E4M3_MAX=E4M3_MAX,
                                    BLOCK_K=min(4096, triton.next_power_of_2(k)), num_warps=8)
    return q.view(torch.float8_e4m3fn), scales

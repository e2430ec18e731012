"""GGUF quantized blocks as MLX quantized matrices, without dequantizing.

MLX's affine quantization stores, per group of ``group_size`` values along a
row, unsigned ``bits``-bit codes ``q`` packed little-endian into uint32
words (element 0 in the lowest bits) and a ``scale`` and ``bias``:
``w = scale·q + bias``. Three ggml block types of 32 values map onto it
exactly, with ``group_size = 32``:

* ``Q8_0`` (f16 ``d``, 32 int8 ``q``; ``w = d·q``): codes ``q + 128`` (8 bits),
  scale ``d``, bias ``-128·d`` (both float16, exact);
* ``Q4_0`` (f16 ``d``, 16 bytes of nibbles; ``w = d·(q - 8)``): codes ``q``
  (4 bits), scale ``d`` (float16), bias ``-8·d`` (computed at use from ``d``);
* ``Q4_1`` (f16 ``d``, f16 ``m``, nibbles; ``w = d·q + m``): codes ``q``,
  scale ``d``, bias ``m`` (float16).

The k-quants' 256-value super-blocks hold 8 sub-blocks of 32 values:

* ``Q4_K`` and ``Q5_K`` (``w = d·sc·q - dmin·m`` per sub-block, 6-bit ``sc``/``m``,
  4- or 5-bit ``q``) map exactly: codes ``q`` (4 or 5 bits), scale ``d·sc``, bias
  ``-dmin·m`` (both exact in float32: an f16 times a 6-bit integer; not in float16).
  The scales and biases are kept as the file's factors, float16 ``d``/``dmin`` per
  super-block and the 6-bit integers as uint8, and multiplied at use
  (:class:`~musegl_mlx.model.GroupProducts`): as float32 arrays they would add 2 bits
  per weight, 1.33x a Q4_K file's bytes;
* ``Q6_K`` (``w = d·sc·(q - 32)`` with an int8 ``sc`` per 16 values) does not: MLX's
  groups have at least 32 values and one scale. Its nearest form at the file's size is
  6-bit codes in groups of 32 with scale ``s = d·sc_big``, ``sc_big`` the scale of larger
  magnitude of the group's two halves, and bias ``-32·s``: that half keeps its codes
  ``q`` (exact but for float32's rounding of ``scale·code + bias``, which MLX computes),
  the other half rounds to the nearest multiple of ``s`` (an error of at most ``s/2``,
  half the bigger half's Q6_K step; at most ``s`` where it reaches ``+32·s``, which
  6 bits cannot hold); :func:`q6_k_error` measures it: about 1 % of the values' RMS on
  random blocks. ``s`` is kept as ``d`` and ``sc_big`` (int8) and multiplied at use.

Resident bytes therefore stay within a few percent of the file's: 8 + 1 bits per
value for Q8_0 (8.5 in the file), 4.5 for Q4_0, 5 for Q4_1, 4.625 for Q4_K (4.5),
5.625 for Q5_K (5.5), 6.625 for Q6_K (6.5625).

ggml packs a Q4 block's 32 nibbles as ``byte j = q[j] | q[j+16] << 4``; MLX
wants consecutive values in consecutive nibbles, so the nibbles are
reordered. MLX packs ``bits``-bit codes as one little-endian bit stream per row
(value 0 in the lowest bits of the first word). Other GGUF types (Q5_0, Q5_1,
IQ ...) have no mapping here and are dequantized by the loader, which says so.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from musegl_core.checkpoint.stored import StoredTensor
from musegl_mlx.model import GroupProducts, Linear

GROUP = 32


@attrs.frozen
class Products:
    """Per-group values ``factor[r, g // per] · multiplier[r, g] · times`` kept as their
    factors (numpy; see :class:`~musegl_mlx.model.GroupProducts`): ``factor`` float16
    ``(rows, groups / per)``, ``multiplier`` small integers ``(rows, groups)`` or None (one
    factor per group)."""

    factor: np.ndarray
    multiplier: np.ndarray | None = None
    times: float = 1.0

    def values(self) -> np.ndarray:
        """The values as a float32 array ``(rows, groups)`` (exact)."""
        out = self.factor.astype(np.float32)
        if self.multiplier is not None:
            rows, groups = self.multiplier.shape
            out = (out[..., None] * self.multiplier.astype(np.float32).reshape(rows, out.shape[1], -1))
            out = out.reshape(rows, groups)
        return out * np.float32(self.times) if self.times != 1.0 else out

    def to_mlx(self, dtype: mx.Dtype, arrays: dict[int, mx.array] | None = None) -> GroupProducts:
        """The MLX form; ``arrays`` shares one MLX array per numpy array (a factor that
        is also another :class:`Products`' factor, or the matrix's scales, is held once)."""
        arrays = {} if arrays is None else arrays

        def shared(a: np.ndarray) -> mx.array:
            if id(a) not in arrays:
                arrays[id(a)] = mx.array(a)
            return arrays[id(a)]

        return GroupProducts(shared(self.factor), None if self.multiplier is None else shared(self.multiplier),
                             self.times, dtype)


def group_values(values: "np.ndarray | Products") -> np.ndarray:
    """Scales or biases as a float32 array."""
    return values.values() if isinstance(values, Products) else np.asarray(values, dtype=np.float32)


def narrowest(values: np.ndarray) -> mx.array:
    """``values`` as an MLX array of bfloat16 or float16 where that holds every value
    exactly (mlx-lm writes its scales in the model's dtype; GGUF scales are float16),
    else float32. MLX's quantized products take any of them beside float32 activations."""
    values = np.asarray(values)
    if values.dtype == np.float16:
        return mx.array(values)
    f32 = np.ascontiguousarray(values, dtype=np.float32)
    if not np.any(f32.view(np.uint32) & 0xFFFF):
        return mx.array(f32).astype(mx.bfloat16)
    with np.errstate(over="ignore"):
        half = f32.astype(np.float16)
    if np.array_equal(half.astype(np.float32), f32):
        return mx.array(half)
    return mx.array(f32)


@attrs.frozen
class QuantizedWeight:
    """A matrix ``shape = (out, in)`` as MLX codes (``packed``, uint32
    ``(out, in·bits/32)``) with ``scales``/``biases`` ``(out, in/group)``: arrays
    (float16 or float32), or :class:`Products` kept as their factors."""

    shape: tuple[int, int]
    packed: np.ndarray
    scales: "np.ndarray | Products"
    biases: "np.ndarray | Products"
    bits: int
    group_size: int = GROUP

    def linear(self, dtype: mx.Dtype) -> Linear:
        """The :class:`Linear` of this matrix. With float32 activations the scales and
        biases keep the narrowest exact dtype (:func:`narrowest`); other activation
        dtypes take them in that dtype (exact for float16 scales in float16; bfloat16
        rounds them)."""

        arrays: dict[int, mx.array] = {}

        def values(v):
            if isinstance(v, Products):
                return v.to_mlx(dtype, arrays)
            if dtype == mx.float32:
                if id(v) not in arrays:
                    arrays[id(v)] = narrowest(v)
                return arrays[id(v)]
            return mx.array(np.asarray(v, dtype=np.float32)).astype(dtype)

        scales = values(self.scales)
        out = Linear(mx.array(self.packed), scales, values(self.biases), self.group_size, self.bits)
        mx.eval(out.arrays())
        return out

    def dense_values(self) -> tuple[np.ndarray, np.ndarray]:
        """``(scales, biases)`` as float32 arrays."""
        return group_values(self.scales), group_values(self.biases)


def _blocks(stored: StoredTensor, block_bytes: int) -> np.ndarray:
    rows, cols = stored.shape
    return np.ascontiguousarray(stored.data).reshape(rows, cols // GROUP, block_bytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry (last axis) read as little-endian float16, as float32."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles_in_order(qs: np.ndarray) -> np.ndarray:
    """ggml Q4 nibbles ``(..., 16)`` bytes -> the 32 codes in value order ``(..., 32)``."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(rows, in)`` (uint8, < 2**bits) -> MLX words ``(rows, in·bits/32)`` uint32."""
    rows = codes.shape[0]
    if bits == 8:
        return np.ascontiguousarray(codes.astype(np.uint8)).view("<u4").reshape(rows, -1)
    if bits == 4:
        pairs = codes.reshape(rows, -1, 2).astype(np.uint8)
        packed_bytes = pairs[..., 0] | (pairs[..., 1] << 4)
        return np.ascontiguousarray(packed_bytes).view("<u4").reshape(rows, -1)
    stream = (codes[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1
    packed_bytes = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed_bytes).view("<u4").reshape(rows, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit (scale, min) pairs of Q4_K/Q5_K super-blocks (``(..., 12)`` bytes) as ``(..., 8)`` each."""
    s = scales.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K ``(..., 128)`` bytes -> the 256 low-4-bit codes in value order: each 32
    bytes give 64 values, the low nibbles first, then the high ones."""
    q = qs.reshape(qs.shape[:-1] + (4, 1, 32)) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    return (q & 0x0F).reshape(qs.shape[:-1] + (256,))


def _super_blocks(stored: StoredTensor, block_bytes: int) -> np.ndarray:
    rows, cols = stored.shape
    return np.ascontiguousarray(stored.data).reshape(rows, cols // 256, block_bytes)


def _q4_k_or_q5_k(stored: StoredTensor) -> QuantizedWeight:
    rows, cols = stored.shape
    five = stored.dtype == "q5_k"
    blocks = _super_blocks(stored, 176 if five else 144)
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0]
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view("<f2")[..., 0]
    sc, mn = _k_scale_min(blocks[..., 4:16])
    if five:
        high = (blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        codes = _k_nibbles(blocks[..., 48:]) | (high.reshape(rows, cols // 256, 256) << 4)
    else:
        codes = _k_nibbles(blocks[..., 16:])
    return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 5 if five else 4),
                           Products(d.astype(np.float16), sc.reshape(rows, -1).astype(np.uint8)),
                           Products(dmin.astype(np.float16), mn.reshape(rows, -1).astype(np.uint8), -1.0),
                           5 if five else 4)


def q6_k_values(stored: StoredTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q6_K matrix's signed codes ``q - 32`` ``(rows, cols)`` (int16) and its per-16-value
    scales ``d·sc`` ``(rows, cols/16)`` (float32, exact)."""
    rows, cols = stored.shape
    blocks = _super_blocks(stored, 210)
    ql, qh = blocks[..., 0:128], blocks[..., 128:192]
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])[..., None]
    low = (ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    q = low.reshape(rows, -1, 8, 32) | (high.reshape(rows, -1, 8, 32) << 4)
    return q.astype(np.int16).reshape(rows, cols) - 32, (d * sc).reshape(rows, -1)


def _q6_k(stored: StoredTensor) -> QuantizedWeight:
    """Q6_K in 6-bit groups of 32 (not exact: see the module docstring)."""
    rows, cols = stored.shape
    blocks = _super_blocks(stored, 210)
    sc = blocks[..., 192:208].view(np.int8).reshape(rows, -1, 2)  # the two 16-value scales of each group
    d = np.ascontiguousarray(blocks[..., 208:210]).view("<f2")[..., 0].astype(np.float16)
    q, step = q6_k_values(stored)
    halves = step.reshape(rows, -1, 2)
    first = np.abs(halves[..., 0]) >= np.abs(halves[..., 1])
    big = np.where(first, sc[..., 0], sc[..., 1]).astype(np.int8)  # (rows, groups)
    scale = np.where(first, halves[..., 0], halves[..., 1])
    safe = np.where(scale == 0, 1, scale)
    values = q.astype(np.float32).reshape(rows, -1, 2, 16) * halves[..., None]
    codes = np.rint(values / safe[..., None, None]) + 32
    # the bigger half's codes are its own q exactly; the other half rounds to its grid
    codes = np.clip(codes, 0, 63).astype(np.uint8).reshape(rows, cols)
    return QuantizedWeight((rows, cols), _pack(codes, 6), Products(d, big), Products(d, big, -32.0), 6)


def q6_k_error(stored: StoredTensor) -> float:
    """The RMS difference between a Q6_K matrix's values and its MLX form, relative to
    the RMS of its values (over its first :data:`CHUNK_ROWS` rows)."""
    from musegl_core.checkpoint.stored import unpack_mlx_codes

    stored = _row_chunk(stored, 0, min(stored.shape[0], CHUNK_ROWS))
    exact = stored.to_float32()
    weight = _q6_k(stored)
    rows, cols = exact.shape
    codes = unpack_mlx_codes(weight.packed, weight.bits, cols).astype(np.float32)
    scales, biases = weight.dense_values()
    approx = (codes.reshape(rows, -1, weight.group_size) * scales[..., None] + biases[..., None]).reshape(rows, cols)
    return float(np.sqrt(np.mean((approx - exact) ** 2) / max(np.mean(exact ** 2), 1e-30)))


#: Rows converted at a time: the conversion's numpy temporaries (float32 values, codes) stay
#: tens of MB however large the matrix (a 30B head is 1.3 billion values).
CHUNK_ROWS = 4096


def _row_chunk(stored: StoredTensor, r0: int, r1: int) -> StoredTensor:
    rows = stored.shape[0]
    data = np.asarray(stored.data).reshape(rows, -1)[r0:r1]
    return StoredTensor(stored.name, stored.dtype, (r1 - r0, stored.shape[1]), data)


def _concatenate(parts: list) -> "np.ndarray | Products":
    if isinstance(parts[0], Products):
        first = parts[0]
        return Products(np.concatenate([p.factor for p in parts]),
                        None if first.multiplier is None else np.concatenate([p.multiplier for p in parts]),
                        first.times)
    return np.concatenate(parts)


def quantized_weight(stored: StoredTensor) -> QuantizedWeight | None:
    """The MLX form of a GGUF quantized matrix, or None when its type does not map.
    Converted :data:`CHUNK_ROWS` rows at a time."""
    if len(stored.shape) != 2:
        return None
    rows = stored.shape[0]
    if rows > CHUNK_ROWS:
        parts = [_quantized_weight(_row_chunk(stored, r0, min(rows, r0 + CHUNK_ROWS)))
                 for r0 in range(0, rows, CHUNK_ROWS)]
        if parts[0] is None:
            return None
        first = parts[0]
        shared = first.biases is not None and isinstance(first.biases, Products) and \
            isinstance(first.scales, np.ndarray) and first.biases.factor is first.scales
        scales = _concatenate([p.scales for p in parts])
        if shared:  # Q4_0: the bias is computed from the scales array itself, held once
            biases = Products(scales, None, first.biases.times)
        else:
            biases = _concatenate([p.biases for p in parts])
        if isinstance(scales, Products) and isinstance(biases, Products) and \
                first.scales.factor is first.biases.factor and first.scales.multiplier is first.biases.multiplier:
            biases = Products(scales.factor, scales.multiplier, first.biases.times)  # Q6_K: one d, one sc
        return QuantizedWeight(stored.shape, np.concatenate([p.packed for p in parts]), scales, biases,
                               first.bits, first.group_size)
    return _quantized_weight(stored)


def _quantized_weight(stored: StoredTensor) -> QuantizedWeight | None:
    if len(stored.shape) != 2:
        return None
    if stored.dtype in ("q4_k", "q5_k", "q6_k") and stored.shape[1] % 256 == 0:
        return _q6_k(stored) if stored.dtype == "q6_k" else _q4_k_or_q5_k(stored)
    if stored.dtype not in ("q8_0", "q4_0", "q4_1") or stored.shape[1] % GROUP:
        return None
    rows, cols = stored.shape
    if stored.dtype == "q8_0":
        blocks = _blocks(stored, 34)
        d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0]
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        with np.errstate(over="ignore"):
            bias = (d * np.float16(-128)).astype(np.float16)
        if not np.all(np.isfinite(bias)):  # beyond float16 (|d| >= 512): float32 biases
            bias = -128.0 * d.astype(np.float32)
        return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 8), d.astype(np.float16), bias, 8)
    if stored.dtype == "q4_0":
        blocks = _blocks(stored, 18)
        d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float16)
        codes = _nibbles_in_order(blocks[..., 2:])
        return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 4), d, Products(d, None, -8.0), 4)
    blocks = _blocks(stored, 20)  # q4_1
    d = np.ascontiguousarray(blocks[..., 0:2]).view("<f2")[..., 0].astype(np.float16)
    m = np.ascontiguousarray(blocks[..., 2:4]).view("<f2")[..., 0].astype(np.float16)
    codes = _nibbles_in_order(blocks[..., 4:])
    return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 4), d, m, 4)

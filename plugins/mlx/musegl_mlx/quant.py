"""GGUF quantized blocks as MLX quantized matrices, without dequantizing.

MLX's affine quantization stores, per group of ``group_size`` values along a
row, unsigned ``bits``-bit codes ``q`` packed little-endian into uint32
words (element 0 in the lowest bits) and a ``scale`` and ``bias``:
``w = scale·q + bias``. Three ggml block types of 32 values map onto it
exactly, with ``group_size = 32``:

* ``Q8_0`` (f16 ``d``, 32 int8 ``q``; ``w = d·q``): codes ``q + 128`` (8 bits),
  scale ``d``, bias ``-128·d``;
* ``Q4_0`` (f16 ``d``, 16 bytes of nibbles; ``w = d·(q - 8)``): codes ``q``
  (4 bits), scale ``d``, bias ``-8·d``;
* ``Q4_1`` (f16 ``d``, f16 ``m``, nibbles; ``w = d·q + m``): codes ``q``,
  scale ``d``, bias ``m``.

The k-quants' 256-value super-blocks hold 8 sub-blocks of 32 values:

* ``Q4_K`` and ``Q5_K`` (``w = d·sc·q - dmin·m`` per sub-block, 6-bit ``sc``/``m``,
  4- or 5-bit ``q``) map exactly: codes ``q`` (4 or 5 bits), scale ``d·sc``, bias
  ``-dmin·m`` (both exact in float32: an f16 times a 6-bit integer);
* ``Q6_K`` (``w = d·sc·(q - 32)`` with an int8 ``sc`` per 16 values) does not: MLX's
  groups have at least 32 values and one scale. Its nearest form is 8-bit codes
  in groups of 32 with scale ``s = |d·sc_big| / 4``, ``sc_big`` the scale of larger
  magnitude of the group's two halves: that half lies on the grid (codes
  ``±4·(q - 32)``; exact but for float32's rounding of ``scale·code + bias``, which
  MLX computes), the other half rounds to the nearest multiple of ``s`` (an error of
  at most ``s/2``, an eighth of the bigger half's Q6_K step; :func:`q6_k_error`
  measures it: about 0.3 % of the values' RMS on random blocks).

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
from musegl_mlx.model import Linear

GROUP = 32


@attrs.frozen
class QuantizedWeight:
    """A matrix ``shape = (out, in)`` as MLX codes (``packed``, uint32
    ``(out, in·bits/32)``) with float32 ``scales``/``biases`` ``(out, in/group)``."""

    shape: tuple[int, int]
    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group_size: int = GROUP

    def linear(self, dtype: mx.Dtype) -> Linear:
        """The :class:`Linear` of this matrix; scales and biases in the activation
        dtype (exact for float16/float32; bfloat16 rounds the f16 scales)."""
        out = Linear(mx.array(self.packed), mx.array(self.scales).astype(dtype),
                     mx.array(self.biases).astype(dtype), self.group_size, self.bits)
        mx.eval(out.weight, out.scales, out.biases)
        return out


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
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, mn = _k_scale_min(blocks[..., 4:16])
    scales, biases = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
    if five:
        high = (blocks[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        codes = _k_nibbles(blocks[..., 48:]) | (high.reshape(rows, cols // 256, 256) << 4)
    else:
        codes = _k_nibbles(blocks[..., 16:])
    return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 5 if five else 4),
                           scales.reshape(rows, -1), biases.reshape(rows, -1), 5 if five else 4)


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
    """Q6_K in 8-bit groups of 32 (not exact: see the module docstring)."""
    rows, cols = stored.shape
    q, step = q6_k_values(stored)
    halves = step.reshape(rows, -1, 2)  # the two 16-value scales of each group of 32
    big = np.where(np.abs(halves[..., 0]) >= np.abs(halves[..., 1]), halves[..., 0], halves[..., 1])
    scale = np.abs(big) / 4
    safe = np.where(scale == 0, 1, scale)
    values = q.astype(np.float32).reshape(rows, -1, 2, 16) * halves[..., None]
    codes = np.rint(values / safe[..., None, None]).reshape(rows, -1, 32)
    # codes lie in [-128, 128]; +128 only where the bigger half's scale is negative and q = 0
    offset = np.where(codes.max(axis=-1) > 127, 127, 128).astype(np.float32)
    codes = np.clip(codes + offset[..., None], 0, 255).astype(np.uint8)
    return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 8), scale.astype(np.float32),
                           (-offset * scale).astype(np.float32), 8)


def q6_k_error(stored: StoredTensor) -> float:
    """The RMS difference between a Q6_K matrix's values and its MLX form, relative to
    the RMS of its values."""
    exact = stored.to_float32()
    weight = _q6_k(stored)
    codes = np.ascontiguousarray(weight.packed).view(np.uint8).reshape(exact.shape).astype(np.float32)
    rows, cols = exact.shape
    approx = (codes.reshape(rows, -1, weight.group_size) * weight.scales[..., None]
              + weight.biases[..., None]).reshape(rows, cols)
    return float(np.sqrt(np.mean((approx - exact) ** 2) / max(np.mean(exact ** 2), 1e-30)))


def quantized_weight(stored: StoredTensor) -> QuantizedWeight | None:
    """The MLX form of a GGUF quantized matrix, or None when its type does not map."""
    if len(stored.shape) != 2:
        return None
    if stored.dtype in ("q4_k", "q5_k", "q6_k") and stored.shape[1] % 256 == 0:
        return _q6_k(stored) if stored.dtype == "q6_k" else _q4_k_or_q5_k(stored)
    if stored.dtype not in ("q8_0", "q4_0", "q4_1") or stored.shape[1] % GROUP:
        return None
    rows, cols = stored.shape
    if stored.dtype == "q8_0":
        blocks = _blocks(stored, 34)
        d = _f16(blocks[..., 0:2])
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 8), d, -128.0 * d, 8)
    if stored.dtype == "q4_0":
        blocks = _blocks(stored, 18)
        d = _f16(blocks[..., 0:2])
        codes = _nibbles_in_order(blocks[..., 2:])
        return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 4), d, -8.0 * d, 4)
    blocks = _blocks(stored, 20)  # q4_1
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = _nibbles_in_order(blocks[..., 4:])
    return QuantizedWeight((rows, cols), _pack(codes.reshape(rows, cols), 4), d, m, 4)

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

ggml packs a Q4 block's 32 nibbles as ``byte j = q[j] | q[j+16] << 4``; MLX
wants consecutive values in consecutive nibbles, so the nibbles are
reordered. Other types (k-quants, Q5) have no such mapping here and are
dequantized by the loader.
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
    pairs = codes.reshape(rows, -1, 2).astype(np.uint8)
    packed_bytes = pairs[..., 0] | (pairs[..., 1] << 4)
    return np.ascontiguousarray(packed_bytes).view("<u4").reshape(rows, -1)


def quantized_weight(stored: StoredTensor) -> QuantizedWeight | None:
    """The MLX form of a GGUF quantized matrix, or None when its type does not map."""
    if stored.dtype not in ("q8_0", "q4_0", "q4_1") or len(stored.shape) != 2 or stored.shape[1] % GROUP:
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

"""FP8 KV in MLX (``--kv-cache-dtype fp8``): float8 e4m3 bytes with a fixed scale per layer,
K or V and KV head, the same scales and bytes as the torch executors (``musegl_cuda.kv_fp8``,
the bounds of :mod:`musegl_core.engine.kv_dtype`).

The caches are ``uint8`` arrays: :func:`mlx.core.to_fp8` writes ``x / scale`` (nearest even,
saturated at ±448, the bytes torch's cast writes) and :func:`mlx.core.from_fp8` reads them back,
times the scale in float32, rounded to the activation dtype.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from musegl_core.engine.kv_dtype import E4M3_MAX, fp8_k_scale, fp8_v_scale


def dense_rows(linear, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a :class:`~musegl_mlx.model.Linear` as float32 (dequantized
    where MLX-quantized)."""
    return np.array(linear.rows(start, stop).astype(mx.float32))


def layer_scales(layer, hidden: int) -> mx.array:
    """``(2, kv_heads)`` float32 K and V scales of a loaded :class:`~musegl_mlx.model.Layer`."""
    nq, nk = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    v = dense_rows(layer.qkvg, nq + nk, nq + 2 * nk)
    heads = np.linalg.norm(v, axis=1).reshape(layer.num_kv_heads, -1).max(axis=1)
    top = float(np.abs(np.array(layer.norms["input_layernorm"].astype(mx.float32))).max())
    k = [fp8_k_scale(layer.head_dim)] * layer.num_kv_heads
    return mx.array(np.array([k, [fp8_v_scale(float(r), top, hidden) for r in heads]], dtype=np.float32))


def quantize(x: mx.array, scale: mx.array) -> mx.array:
    """``x (rows, kv_heads, hd) / scale (kv_heads,)`` as e4m3 bytes (``uint8``)."""
    return mx.to_fp8(mx.clip(x.astype(mx.float32) / scale[:, None], -E4M3_MAX, E4M3_MAX))


def dequantize(codes: mx.array, scale: mx.array, dtype: mx.Dtype) -> mx.array:
    """e4m3 bytes ``(..., kv_heads, hd)`` as ``stored · scale`` in ``dtype``."""
    return (mx.from_fp8(codes, dtype=mx.float32) * scale[:, None]).astype(dtype)

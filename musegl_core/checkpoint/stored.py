"""Weights in their stored form: half precision or GGUF quantized blocks, not upcast.

:meth:`Checkpoint.read_stored` returns a :class:`StoredTensor` so an executor
can keep a ``f16``/``bf16`` matrix in 2 bytes per value, or a GGUF ``Q8_0`` /
``Q4_0`` / ``Q4_K`` ... matrix in its blocks, and run kernels that read them
directly. The layout is the transformers layout, as :meth:`Checkpoint.read`
gives it: GGUF Q/K rows are un-permuted and fused QKV split (both are row
operations, so they apply to quantized rows unchanged).

``data`` per ``dtype``:

- ``f32``: ``float32`` array of ``shape``.
- ``f16``: ``float16`` array of ``shape``.
- ``bf16``: ``uint16`` array of ``shape`` holding the bfloat16 bit patterns
  (numpy has no bfloat16; ``torch.from_numpy(data).view(torch.bfloat16)`` or
  ``mx.array(data).view(mx.bfloat16)`` reinterpret them without a copy).
- a GGUF quantized type (``q8_0``, ``q4_0``, ``q4_k`` ...; :attr:`ggml_type`
  is the ``gguf.GGMLQuantizationType``): ``uint8`` array ``(rows, row_bytes)``,
  the ggml blocks of each logical row, in file order. Blocks run along the
  input (last) dimension: ``row_bytes = shape[-1] // block_size * type_size``.

- ``f8_e4m3`` (FP8 checkpoints, :data:`FP8`): ``uint8`` array of ``shape``, the
  float8 e4m3fn bit patterns, with float32 :attr:`StoredTensor.scales` over
  blocks of :attr:`StoredTensor.scale_block` ``(bn, bk)`` values: ``W[i, j] =
  q[i, j] · scales[i // bn, j // bk]`` (one scale for the whole matrix:
  ``(rows, cols)``; one per output row: ``(1, cols)``; 128 x 128 blocks).
- an MLX affine-quantized matrix as mlx-lm's converter writes it (``mlx_q{bits}_g{group}``,
  :func:`mlx_dtype`): ``data`` the uint32 words ``(rows, cols·bits/32)`` (codes packed
  little-endian, value 0 in the lowest bits), ``scales`` and ``biases`` float32
  ``(rows, cols/group)``; ``w = scale·code + bias``.

1-D tensors (the norms) are always ``f32``: the centered norms' stored ``+1``
is removed in float32, as :meth:`Checkpoint.read` does.
"""

from __future__ import annotations

from typing import Any

import attrs
import gguf
import numpy as np

HALF_DTYPES = ("f16", "bf16")
#: The dtype tag of float8 e4m3fn weights with block scales.
FP8 = "f8_e4m3"


def e4m3_to_float32(bits: np.ndarray) -> np.ndarray:
    """float8 e4m3fn bit patterns (uint8) as float32, exactly: the bits moved into a
    float16's sign, exponent and mantissa give the value times 2^-8 (normal and
    subnormal alike). The NaN patterns (0x7F, 0xFF) decode as ±480, which no quantizer writes."""
    bits = np.asarray(bits, dtype=np.uint8).astype(np.uint16)
    half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half.view(np.float16).astype(np.float32) * np.float32(256.0)
MLX_PREFIX = "mlx_q"


def mlx_dtype(bits: int, group_size: int) -> str:
    """The dtype tag of an MLX affine-quantized matrix: ``mlx_q4_g64``."""
    return f"{MLX_PREFIX}{bits}_g{group_size}"


def mlx_layout(dtype: str) -> tuple[int, int] | None:
    """``(bits, group_size)`` of an :func:`mlx_dtype` tag, None for any other dtype."""
    if not dtype.startswith(MLX_PREFIX):
        return None
    bits, group = dtype[len(MLX_PREFIX):].split("_g")
    return int(bits), int(group)


def unpack_mlx_codes(words: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """MLX packed codes (uint32 words, little-endian bit stream per row) -> uint8 ``(rows, cols)``."""
    rows = words.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(words).view(np.uint8).reshape(rows, -1), axis=-1,
                           bitorder="little")[:, :cols * bits].reshape(rows, cols, bits)
    return (stream.astype(np.uint8) << np.arange(bits, dtype=np.uint8)).sum(axis=-1, dtype=np.uint8)


def ggml_type_name(qtype: gguf.GGMLQuantizationType) -> str:
    """``GGMLQuantizationType.Q4_K`` -> ``"q4_k"``."""
    return qtype.name.lower()


@attrs.frozen
class StoredTensor:
    """One weight as stored: ``dtype`` tag, logical ``shape`` (transformers order) and ``data``.

    See the module docstring for what ``data`` holds per ``dtype``.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray = attrs.field(repr=False)
    #: ``f8_e4m3``: float32 scales ``(ceil(rows/bn), ceil(cols/bk))`` with the block ``(bn, bk)``;
    #: MLX affine matrices: float32 scales ``(rows, cols/group)`` beside :attr:`biases` (see the module
    #: docstring); None otherwise
    scales: np.ndarray | None = attrs.field(default=None, repr=False)
    scale_block: tuple[int, int] | None = None
    biases: np.ndarray | None = attrs.field(default=None, repr=False)

    @property
    def quantized(self) -> bool:
        """True for GGUF block formats (anything but ``f32``/``f16``/``bf16``)."""
        return self.dtype not in ("f32",) + HALF_DTYPES

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        """The ggml type of the data (``F32``, ``F16``, ``BF16`` or a quantized type; not for MLX matrices)."""
        return gguf.GGMLQuantizationType[self.dtype.upper()]

    @property
    def block_size(self) -> int:
        """Values per quantization block (1 for f32/f16/bf16)."""
        return int(gguf.GGML_QUANT_SIZES[self.ggml_type][0])

    @property
    def nbytes(self) -> int:
        extra = sum(int(a.nbytes) for a in (self.scales, self.biases) if a is not None)
        return int(self.data.nbytes) + extra

    def to_float32(self) -> np.ndarray:
        """The values as a new float32 array of ``shape`` (what :meth:`Checkpoint.read` gives)."""
        if self.dtype == "f32":
            return np.array(self.data, dtype=np.float32, copy=True)
        if self.dtype == "f16":
            return self.data.astype(np.float32)
        if self.dtype == "bf16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        if self.dtype == FP8:
            assert self.scales is not None and self.scale_block is not None
            bn, bk = self.scale_block
            rows, cols = self.shape
            scales = np.asarray(self.scales, dtype=np.float32)
            full = np.repeat(np.repeat(scales, bn, axis=0)[:rows], bk, axis=1)[:, :cols]
            return e4m3_to_float32(self.data) * full
        layout = mlx_layout(self.dtype)
        if layout is not None:
            bits, group = layout
            rows, cols = self.shape
            codes = unpack_mlx_codes(self.data, bits, cols).astype(np.float32).reshape(rows, cols // group, group)
            scales = np.asarray(self.scales, dtype=np.float32)[..., None]
            biases = np.asarray(self.biases, dtype=np.float32)[..., None]
            return (scales * codes + biases).reshape(rows, cols)
        try:
            values = gguf.quants.dequantize(self.data, self.ggml_type)
        except NotImplementedError:
            raise ValueError(f"{self.name}: type {self.dtype} cannot be decoded "
                             "(gguf.quants has no dequantizer for it)") from None
        return np.array(values, dtype=np.float32, copy=True).reshape(self.shape)


def stored_from_gguf(name: str, tensor: Any, rows: slice | None = None) -> StoredTensor:
    """A GGUF tensor (``GGUFFile`` tensor, optionally a slice of its rows) in stored form,
    torch-order ``shape``; quantized/bf16 data as described in the module docstring."""
    qtype = tensor.tensor_type
    ne = [int(n) for n in tensor.shape]
    shape = tuple(reversed(ne))
    data = tensor.data if rows is None else tensor.data[rows]
    if rows is not None:
        shape = (data.shape[0],) + shape[1:]
    if qtype == gguf.GGMLQuantizationType.F32:
        return StoredTensor(name, "f32", shape, np.asarray(data, dtype=np.float32))
    if qtype == gguf.GGMLQuantizationType.F16:
        return StoredTensor(name, "f16", shape, np.asarray(data, dtype=np.float16))
    if qtype == gguf.GGMLQuantizationType.BF16:
        return StoredTensor(name, "bf16", shape, np.asarray(data).view(np.uint16).reshape(shape))
    if qtype in (gguf.GGMLQuantizationType.F64, gguf.GGMLQuantizationType.I8, gguf.GGMLQuantizationType.I16,
                 gguf.GGMLQuantizationType.I32, gguf.GGMLQuantizationType.I64):
        return StoredTensor(name, "f32", shape, np.asarray(data, dtype=np.float32))
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {tensor.name}: quantized tensors must be 2-D, got shape {shape}")
    return StoredTensor(name, ggml_type_name(qtype), shape, np.asarray(data, dtype=np.uint8))


def unpermute_stored_rows(stored: StoredTensor, n_heads: int) -> StoredTensor:
    """GGUF -> transformers RoPE row order, on values or on quantized rows alike."""
    out = stored.shape[0]
    hd = out // n_heads
    data = stored.data
    inner = data.shape[1:]
    moved = data.reshape((n_heads, hd // 2, 2) + inner).swapaxes(1, 2).reshape(data.shape)
    return attrs.evolve(stored, data=np.ascontiguousarray(moved))

"""A weight matrix kept in its stored form on the CPU, multiplied by the C kernels.

:class:`StoredMatrix` holds the bytes of ``rows`` weight rows of ``cols``
values each (float32, float16, bfloat16 or GGUF Q8_0/Q4_0/Q4_K/Q5_K/Q6_K blocks, as
:class:`~musegl_core.checkpoint.stored.StoredTensor` gives them, or mlx-lm's 4-bit
codes in groups of 64 laid out again as the kernels' A4 blocks: :func:`mlx_a4_blocks`) in one uint8
torch tensor. ``x @ W^T`` runs ``mw_matmul`` of the kernel path
:mod:`musegl_cuda.cpu.native` chose (AVX-512 or AVX2): decode steps decode each
weight row in registers and read the weight once; wide products (prefill
chunks) decode a few weight rows at a time into a cached float32 scratch. Every
row count sums each output in one order, so a row's result does not depend on
the rows beside it (bit for bit). The rows a :class:`HalfRows` names (prompt
rows nobody samples) are multiplied with float16 matrices in float16
arithmetic instead, where the CPU has AVX512-FP16 (``mw_gemm_f16``, also
independent of the other rows). Activations and results are float32.
:class:`DenseMatrix` is the float32 fallback where no kernels run.
"""

from __future__ import annotations

import ctypes
import logging

import attrs
import numpy as np
import torch

from musegl_core.checkpoint.stored import StoredTensor, mlx_layout
from musegl_cuda.cpu import native
from musegl_cuda.cpu.fixed_blocks import fixed_block_linear

log = logging.getLogger("musegl.cuda")

# stored dtype tag -> (kernel type code, values per block)
KINDS = {"f32": (0, 32), "f16": (1, 32), "bf16": (2, 32), "q8_0": (8, 32), "q4_0": (4, 32), "q4_k": (12, 256),
         "q5_k": (13, 256), "q6_k": (14, 256), "a4_f32": (20, 64), "a4_f16": (21, 64), "a4_bf16": (22, 64)}
#: The MLX affine layout the kernels run (mlx-lm's default: 4-bit codes, groups of 64).
A4_LAYOUT = (4, 64)
#: Prompt rows that nobody samples (see :class:`HalfRows`) are multiplied with float16
#: matrices in float16 arithmetic where the CPU has AVX512-FP16 (``mw_gemm_f16``: twice
#: float32's multiply-adds per instruction, and no float32 copy of the matrix); False keeps
#: every row in float32. See docs/executor.md.
HALF_GEMM = True


@attrs.frozen
class HalfRows:
    """Which rows of a step's products may run in float16 arithmetic: ``half``, the rows
    nobody samples (prompt rows of a prefill chunk), and ``exact``, the rest (int64 row
    indices). Sampled rows always stay in float32, so a sampled row's logits never depend
    on whether other rows share its step; a half row's result does not depend on the
    other rows either (``mw_gemm_f16`` sums the same products in the same order whatever
    the call's rows)."""

    half: torch.Tensor
    exact: torch.Tensor

    @classmethod
    def of(cls, sampled: list[bool]) -> "HalfRows | None":
        """From each packed row's "is sampled" flag; None when every row is sampled.
        (Whether float16 arithmetic applies is :attr:`StoredMatrix.half_capable`'s
        business, :data:`HALF_GEMM` included; the float32 fallback runs the two kinds
        of rows in different fixed shapes, :class:`DenseMatrix`.)"""
        if all(sampled):
            return None
        flags = torch.tensor(sampled, dtype=torch.bool)
        return cls(torch.nonzero(~flags).flatten(), torch.nonzero(flags).flatten())


_overflow_warned = False


def _warn_overflow_once() -> None:
    global _overflow_warned
    if not _overflow_warned:
        _overflow_warned = True
        log.warning("a prompt product left float16's range; such products run in float32 (slower)")


def supported(stored: StoredTensor) -> bool:
    """True when the kernels can run ``stored`` as it is (its type, and rows that fill whole blocks)."""
    kind = KINDS.get(stored.dtype)
    return kind is not None and len(stored.shape) == 2 and stored.shape[1] % kind[1] == 0


class StoredMatrix:
    """``rows x cols`` weight in stored form; see the module docstring."""

    def __init__(self, dtype: str, data: torch.Tensor, rows: int, cols: int, threads: int | None = None,
                 kernels: native.Kernels | None = None) -> None:
        """``kernels``: the build to run (default: the one :func:`native.load` chose)."""
        kernels = kernels or native.load()
        if kernels is None:
            raise RuntimeError(f"stored-weight kernels unavailable: {native.unavailable_reason()}")
        if dtype not in KINDS:
            raise ValueError(f"no CPU kernel for weight dtype {dtype!r} (kernels: {', '.join(KINDS)})")
        self.kernels = kernels
        self._lib = lib = kernels.lib
        self.dtype = dtype
        self.code, block = KINDS[dtype]
        if cols % block:
            raise ValueError(f"{dtype} rows of {cols} values do not fill {block}-value blocks")
        self.rows, self.cols = rows, cols
        self.row_bytes = int(lib.mw_row_bytes(self.code, cols))
        if data.dtype != torch.uint8 or tuple(data.shape) != (rows, self.row_bytes) or not data.is_contiguous():
            raise ValueError(f"stored {dtype} data must be contiguous uint8 ({rows}, {self.row_bytes}), "
                             f"got {data.dtype} {tuple(data.shape)}")
        self.data = data
        self.threads = threads or torch.get_num_threads()

    @classmethod
    def from_stored(cls, stored: StoredTensor, kernels: native.Kernels | None = None) -> "StoredMatrix":
        rows, cols = stored.shape
        raw = np.ascontiguousarray(stored.data).view(np.uint8).reshape(rows, -1)
        return cls(stored.dtype, torch.from_numpy(raw.copy()), rows, cols, kernels=kernels)

    @classmethod
    def concat(cls, parts: list["StoredMatrix"]) -> "StoredMatrix":
        """One matrix of the rows of ``parts`` (same dtype and width), in order."""
        first = parts[0]
        if any(p.dtype != first.dtype or p.cols != first.cols for p in parts):
            raise ValueError("stored matrices to stack must share dtype and width")
        return cls(first.dtype, torch.cat([p.data for p in parts]), sum(p.rows for p in parts), first.cols,
                   kernels=first.kernels)

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def matmul(self, x: torch.Tensor, half: HalfRows | None = None) -> torch.Tensor:
        """``x @ W^T`` (float32 result) for float32 ``x`` of shape ``(m, cols)``; the rows
        ``half`` names run in float16 arithmetic where :attr:`half_capable`."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"expected float32 (m, {self.cols}) activations, got {x.dtype} {tuple(x.shape)}")
        if half is not None and self.half_capable:
            if half.half.numel() < half.exact.numel():  # a few prompt rows: gather them
                y = self._exact(x)
                return y.index_copy_(0, half.half, self._half_gemm(x.index_select(0, half.half)))
            # mostly prompt rows: every row in float16 (no gather of the many), then the
            # sampled rows again in float32 over them
            y = self._half_gemm(x)
            if half.exact.numel():
                y.index_copy_(0, half.exact, self._exact(x.index_select(0, half.exact)))
            return y
        return self._exact(x)

    @property
    def half_capable(self) -> bool:
        """True for a float16 matrix on a CPU with AVX512-FP16 (and :data:`HALF_GEMM` on)."""
        return self.code == KINDS["f16"][0] and HALF_GEMM and self.kernels.half_gemm

    def _exact(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` in float32 arithmetic (``mw_matmul``: each row's result the same
        whatever the other rows)."""
        m = x.shape[0]
        x = x.contiguous()
        y = torch.empty(m, self.rows, dtype=torch.float32)
        self._lib.mw_matmul(self.code, self.data.data_ptr(), self.rows, self.cols, x.data_ptr(), self.cols,
                            m, y.data_ptr(), self.rows, self.threads)
        return y

    def _half_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for a float16 ``W`` and many rows, in float16 arithmetic
        (``mw_gemm_f16``: activations rounded to float16, float16 partial sums widened
        to float32 per product; see :data:`HALF_GEMM`)."""
        m = x.shape[0]
        x = x.contiguous()
        xh = torch.empty(m, self.cols, dtype=torch.float16)  # rounded on the kernels' threads, not torch's
        y = torch.empty(m, self.rows, dtype=torch.float32)
        overflow = self._lib.mw_gemm_f16(self.data.data_ptr(), self.rows, self.cols, x.data_ptr(), self.cols, m,
                                         y.data_ptr(), self.rows, xh.data_ptr(), self.threads)
        if overflow:  # an activation or a partial sum beyond float16's range: this product in float32
            _warn_overflow_once()
            return self._exact(x)
        return y

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``rows`` (int64 indices; all when None) decoded to float32 ``(len, cols)``."""
        if rows is None:
            count, ptr = self.rows, None
        else:
            rows = rows.to(torch.int64).contiguous()
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.rows):
                raise IndexError(f"row index outside 0..{self.rows - 1}")
            count, ptr = rows.numel(), ctypes.c_void_p(rows.data_ptr())
        out = torch.empty(count, self.cols, dtype=torch.float32)
        if count:
            self._lib.mw_dequant_rows(self.code, self.data.data_ptr(), self.cols, ptr, count, out.data_ptr(),
                                      self.threads)
        return out


class DenseMatrix:
    """A float32 matrix with :class:`StoredMatrix`'s interface, for weights the
    kernels cannot run (rows that do not fill 32-value blocks, or no kernels on this
    machine), multiplied by torch in fixed-size row blocks so rows stay independent of
    their batch (:func:`~musegl_cuda.cpu.fixed_blocks.fixed_block_linear`).
    ``source_dtype`` is what the checkpoint stored."""

    dtype = "f32"

    def __init__(self, weight: torch.Tensor, source_dtype: str = "f32") -> None:
        self.weight = weight.to(torch.float32).contiguous()
        self.rows, self.cols = self.weight.shape
        self.source_dtype = source_dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def matmul(self, x: torch.Tensor, half: HalfRows | None = None) -> torch.Tensor:
        """``x @ W^T`` in float32. Sampled rows (all of them when ``half`` is None: decode
        rows, a prompt's last row) run in blocks of :data:`native.SAMPLED_ROWS` rows, the
        rows ``half`` names (prompt rows nobody samples) in blocks of
        :data:`native.FALLBACK_ROWS`; each way a row's result does not depend on the other
        rows (see :mod:`~musegl_cuda.cpu.fixed_blocks`)."""
        if half is None:
            return fixed_block_linear(x, self.weight, native.SAMPLED_ROWS)
        if not half.exact.numel():
            return fixed_block_linear(x, self.weight, native.FALLBACK_ROWS)
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        out.index_copy_(0, half.half, fixed_block_linear(x.index_select(0, half.half), self.weight,
                                                         native.FALLBACK_ROWS))
        return out.index_copy_(0, half.exact, fixed_block_linear(x.index_select(0, half.exact), self.weight,
                                                                 native.SAMPLED_ROWS))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.weight.clone() if rows is None else self.weight[rows]


def _a4_scale_dtype(scales: np.ndarray, biases: np.ndarray) -> str:
    """The narrowest of bfloat16, float16, float32 that holds every scale and bias exactly
    (the reader gives them as float32; mlx-lm writes them in the model's dtype)."""
    both = np.concatenate([np.ravel(scales), np.ravel(biases)]).astype(np.float32)
    if not np.any(both.view(np.uint32) & 0xFFFF):
        return "bf16"
    with np.errstate(over="ignore"):
        if np.array_equal(both.astype(np.float16).astype(np.float32), both):
            return "f16"
    return "f32"


def mlx_a4_blocks(stored: StoredTensor, chunk_rows: int = 4096) -> tuple[str, np.ndarray]:
    """An MLX 4-bit, group-64 matrix (mlx-lm's layout) as the kernels' A4 blocks:
    ``(kind, uint8 (rows, row_bytes))``. Per group of 64 values: its scale and bias in the
    narrowest exact dtype (``kind``: ``a4_bf16``, ``a4_f16`` or ``a4_f32``), then 32
    bytes of nibbles in Q4_0's order (byte ``j`` of each 32 values holds values ``j`` and
    ``j + 16``; MLX holds values ``2i`` and ``2i + 1`` in byte ``i``). The same bytes as
    the file's tensors (codes, scales, biases) when the kind is the file's scale dtype."""
    rows, cols = stored.shape
    scales = np.asarray(stored.scales, dtype=np.float32)
    biases = np.asarray(stored.biases, dtype=np.float32)
    kind = _a4_scale_dtype(scales, biases)
    size = {"bf16": 2, "f16": 2, "f32": 4}[kind]
    groups = cols // 64
    out = np.empty((rows, groups, 2 * size + 32), dtype=np.uint8)
    words = np.ascontiguousarray(stored.data).view(np.uint8).reshape(rows, cols // 2)
    for r0 in range(0, rows, chunk_rows):  # row chunks: the unpacked codes stay small
        r1 = min(rows, r0 + chunk_rows)
        packed = words[r0:r1]
        codes = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(r1 - r0, cols // 32, 32)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        out[r0:r1, :, 2 * size:] = nibbles.reshape(r1 - r0, groups, 32)
        for i, values in enumerate((scales[r0:r1], biases[r0:r1])):
            if kind == "bf16":
                raw = (values.view(np.uint32) >> 16).astype("<u2")
            elif kind == "f16":
                raw = values.astype("<f2")
            else:
                raw = values.astype("<f4")
            out[r0:r1, :, i * size:(i + 1) * size] = raw.view(np.uint8).reshape(r1 - r0, groups, size)
    return f"a4_{kind}", out.reshape(rows, -1)


def stored_matrix(stored: StoredTensor) -> StoredMatrix | DenseMatrix:
    """The weight as a :class:`StoredMatrix` where the kernels run it (mlx-lm's 4-bit,
    group-64 matrices as A4 blocks: :func:`mlx_a4_blocks`); another type (Q5_0, Q4_1,
    other MLX layouts ...) decoded to float32 and run by the kernels' f32 path where its
    rows fill 32-value blocks; else a float32 :class:`DenseMatrix`."""
    kernels = native.load()
    if kernels is not None and supported(stored):
        return StoredMatrix.from_stored(stored, kernels)
    if kernels is not None and mlx_layout(stored.dtype) == A4_LAYOUT and len(stored.shape) == 2 \
            and stored.shape[1] % 64 == 0:
        kind, blocks = mlx_a4_blocks(stored)
        return StoredMatrix(kind, torch.from_numpy(blocks), stored.shape[0], stored.shape[1], kernels=kernels)
    weight = np.ascontiguousarray(stored.to_float32(), dtype=np.float32)
    f32 = StoredTensor(stored.name, "f32", stored.shape, weight)
    if kernels is not None and supported(f32):
        return StoredMatrix.from_stored(f32, kernels)
    return DenseMatrix(torch.from_numpy(weight), stored.dtype)


class StoredGroup:
    """Matrices sharing one input (q/k/v/gate, gate/up): ``matmul`` returns their
    outputs side by side. Consecutive parts of one dtype are stacked into one
    matrix, so a uniform checkpoint runs one product per group."""

    def __init__(self, parts: list[StoredMatrix | DenseMatrix]) -> None:
        merged: list[StoredMatrix | DenseMatrix] = []
        for part in parts:
            last = merged[-1] if merged else None
            if (isinstance(part, StoredMatrix) and isinstance(last, StoredMatrix)
                    and last.dtype == part.dtype and last.cols == part.cols):
                merged[-1] = StoredMatrix.concat([last, part])
            else:
                merged.append(part)
        self.parts = merged

    @property
    def kernels(self) -> native.Kernels | None:
        """The build the group's stored matrices run on (None when every part is float32 torch)."""
        return next((p.kernels for p in self.parts if isinstance(p, StoredMatrix)), None)

    def matmul(self, x: torch.Tensor, half: HalfRows | None = None) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].matmul(x, half)
        return torch.cat([p.matmul(x, half) for p in self.parts], dim=1)

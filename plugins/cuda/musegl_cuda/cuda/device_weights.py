"""Weight matrices on the GPU in their stored form (``--weights stored`` on CUDA).

A :class:`~musegl_core.checkpoint.stored.StoredTensor` becomes one of:

* :class:`GGUFMatrix`: GGUF ``Q8_0``/``Q4_0``/``Q4_K``/``Q5_K``/``Q6_K`` blocks as the
  file stores them, gathered by :mod:`musegl_cuda.cuda.quantized` and multiplied by its
  GEMV (up to :data:`GEMV_ROWS` rows, :mod:`musegl_cuda.cuda.gemv`), its tiles, or (from
  :data:`SCRATCH_ROWS` rows) ``F.linear`` on a decoded scratch;
* :class:`FP8Matrix`: float8 e4m3 weights with float32 block scales (an FP8
  checkpoint as published, or a half-precision matrix quantized at load with
  ``--quantization fp8``: one scale per output row). A product of fewer than
  ``w8a8_rows`` activation rows dequantizes the weights in the Triton kernels
  (weight-only: the GEMV up to :data:`GEMV_ROWS` rows, the tiles past it); a wider one
  quantizes the activations per row to e4m3 and runs ``torch._scaled_mm`` (W8A8), where the scales allow it (one per matrix or per
  output row, and both dimensions multiples of 16; other matrices always run weight-only);
* :class:`DenseMatrix`: every other matrix (f16/bf16/f32, and GGUF types without a
  kernel here, decoded at load) in the activation dtype, through ``F.linear``.

Every class offers ``matmul(x)`` (``x @ W^T`` in ``x.dtype``), ``rows(ids)`` (the
embedding's gather, decoded to the activation dtype, or to ``dtype``) and ``nbytes``; :class:`MatrixGroup` stacks the
matrices that share an input (q/k/v/gate, gate/up). Nothing here reads a device
value on the host, so decode steps capture into CUDA graphs as with bf16.
"""

from __future__ import annotations

import logging
import os
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from musegl_core.checkpoint.stored import FP8, HALF_DTYPES, StoredTensor
from musegl_cuda.cuda import gemv
from musegl_cuda.cuda.quantized import GGUF_LAYOUTS, fp8_matmul, gguf_matmul, gguf_rows, quantize_rows_e4m3
from musegl_cuda.quantization import E4M3_MAX, quantize_fp8

log = logging.getLogger("musegl.cuda")

#: GGUF products of at least this many activation rows decode the matrix into a scratch in
#: the activation dtype (``gemv.gguf_dequant``, :data:`SCRATCH_BYTES` of it at a time) and run
#: ``F.linear`` (cuBLAS) on it, instead of the Triton kernel's dequantized tiles; None: the
#: kernel at every width. The kernel decodes every weight tile once per 64 activation rows and
#: splits no depth past 16 rows, so a 4,096-row prefill decoded each weight 64 times: on an
#: H100 (benchmarks/results/gpu_quantized_2026-12-07_h100, 30B shape, 26 layers, the kernel at
#: every width) Q4_K_M prefilled 890 tok/s against bf16's 23,677, and a batch-64 step took
#: 106 ms against bf16's 10.9, while the batch-1 step (one decode of every weight) took 22 ms:
#: a scratch costs about one such decode plus bf16's product. Past the decode kernels'
#: 16 rows (the tiles split no depth there, so a 30B matrix ran about one program per
#: multiprocessor) the scratch is taken. At 32 rows the scratch was the faster on an H100
#: (four layers of Q4_K products: 2,718 us against the tiles' 3,933,
#: benchmarks/results/gpu_quantized_2026-12-07_h100_b); between 9 and 31 rows it was not timed
#: (``benchmarks/gpu_quantized_products.py --rows``).
SCRATCH_ROWS: int | None = 17
#: GGUF and FP8 products of at most this many activation rows run the skinny decode kernels
#: (:mod:`musegl_cuda.cuda.gemv`: CUDA-core products reading each stored byte once) instead
#: of the tensor-core tiles; 0 turns them off. ``MUSEGL_CUDA_GEMV_ROWS`` and
#: ``MUSEGL_CUDA_SCRATCH_ROWS`` (a number, or ``off``) override these two at import, so that a
#: benchmark can time the executor both ways without a code change. Only on CUDA: under
#: Triton's interpreter (the CPU tests) the model runs the tiles, whose few programs interpret
#: faster; ``quantized_checks.check_gemv`` checks these kernels there directly.
GEMV_ROWS = gemv.GEMV_ROWS


def _env_rows(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return default
    return None if value.strip().lower() in ("off", "none", "") else int(value)


GEMV_ROWS = min(_env_rows("MUSEGL_CUDA_GEMV_ROWS", GEMV_ROWS) or 0, gemv.GEMV_ROWS)
#: GGUF types whose skinny products run the tensor-core tiles instead of the GEMV kernel: on an
#: H100 (benchmarks/results/gpu_quantized_2026-12-07_h100_b, four layers of the 30B products) the
#: Q4_K GEMV took 701 us at one row and 1,563 at eight against the tiles' 680 and 982 (no GEMV
#: config reached more than 394 GB/s), while Q6_K's took 420 and 977 against 1,063 and 1,283.
TILES_NOT_GEMV = frozenset({"q4_k"})
SCRATCH_ROWS = _env_rows("MUSEGL_CUDA_SCRATCH_ROWS", SCRATCH_ROWS)
#: Most bytes of scratch one product decodes at a time (its weight rows in slabs), so that a
#: wide matrix (the fused gate/up, the head) holds no whole decoded copy beside the KV pool.
SCRATCH_BYTES = 64 << 20
#: A scratch slab's rows are a multiple of this (see ``GGUFMatrix._via_scratch``).
SLAB_ALIGN = 128
#: Products of at least this many activation rows run W8A8 (``torch._scaled_mm``), fewer
#: rows weight-only (the Triton kernel); ``--fp8-w8a8-rows`` sets it. Not yet measured on a
#: GPU: ``benchmarks/gpu_fp8_products.py`` times both ways at 1 and 64 rows and a prefill
#: chunk, so that this default can follow the faster one for each.
W8A8_ROWS = 32


class DenseMatrix:
    """A matrix in the activation dtype, multiplied by ``F.linear``."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, source_dtype: str) -> None:
        self.weight = weight.contiguous()
        self.rows_count, self.cols = self.weight.shape
        self.dtype = source_dtype

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = F.embedding(ids, self.weight)
        return out if dtype is None else out.to(dtype)

    @staticmethod
    def concat(parts: list["DenseMatrix"]) -> "DenseMatrix":
        return DenseMatrix(torch.cat([p.weight for p in parts]), parts[0].dtype)


class GGUFMatrix:
    """GGUF blocks on the device: ``data`` uint8 ``(rows, row_bytes)``."""

    kind = "gguf"

    def __init__(self, dtype: str, data: torch.Tensor, rows: int, cols: int, act_dtype: torch.dtype,
                 scratch_rows: int | None = SCRATCH_ROWS) -> None:
        if dtype not in GGUF_LAYOUTS:
            raise ValueError(f"no CUDA kernel for GGUF type {dtype!r}")
        _, vb, bb, _ = GGUF_LAYOUTS[dtype]
        if cols % vb or tuple(data.shape) != (rows, cols // vb * bb) or data.dtype != torch.uint8:
            raise ValueError(f"{dtype} data of shape {tuple(data.shape)} is not {rows} rows of {cols} values")
        self.dtype = dtype
        self.data = data.contiguous()
        self.rows_count, self.cols = rows, cols
        self.act_dtype = act_dtype
        self.scratch_rows = scratch_rows  # see SCRATCH_ROWS
        self.gemv_rows = 0 if dtype in TILES_NOT_GEMV else GEMV_ROWS

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.scratch_rows is not None and x.shape[0] >= self.scratch_rows:
            return self._via_scratch(x, out)
        if 0 < x.shape[0] <= self.gemv_rows and x.is_cuda:
            return gemv.gguf_gemv(x.contiguous(), self.data, self.dtype, self.rows_count, self.cols, out)
        return gguf_matmul(x.contiguous(), self.data, self.dtype, self.rows_count, self.cols, out)

    def _via_scratch(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T`` through the weight rows decoded to ``x.dtype`` (:func:`gemv.gguf_dequant`),
        a slab of at most :data:`SCRATCH_BYTES` at a time, each slab's product by ``F.linear``."""
        n = self.rows_count
        # whole multiples of SLAB_ALIGN rows: a slab's product writes rows of `count` values, and
        # cuBLAS takes its Hopper kernels only for 16-byte aligned rows (a 5,041-row slab ran
        # sm75 CUTLASS products, 85 % of a Q4_K_M prefill step on an H100:
        # benchmarks/results/gpu_quantized_2026-12-07_h100_b)
        slab = max(SLAB_ALIGN, SCRATCH_BYTES // (self.cols * x.element_size()) // SLAB_ALIGN * SLAB_ALIGN)
        if slab >= n:
            y = F.linear(x, gemv.gguf_dequant(self.data, self.dtype, n, self.cols, x.dtype))
            return y if out is None else out.copy_(y)
        y = out if out is not None else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, slab):
            count = min(slab, n - start)
            part = gemv.gguf_dequant(self.data[start:start + count], self.dtype, count, self.cols, x.dtype)
            y[:, start:start + count] = F.linear(x, part)
        return y

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return gguf_rows(ids.contiguous(), self.data, self.dtype, self.cols, dtype or self.act_dtype)

    @staticmethod
    def concat(parts: list["GGUFMatrix"]) -> "GGUFMatrix":
        first = parts[0]
        merged = GGUFMatrix(first.dtype, torch.cat([p.data for p in parts]), sum(p.rows_count for p in parts),
                            first.cols, first.act_dtype, first.scratch_rows)
        merged.gemv_rows = first.gemv_rows
        return merged


class FP8Matrix:
    """float8 e4m3 weights ``(rows, cols)`` with float32 ``scales`` over ``block`` (see the
    module docstring for which products run weight-only and which W8A8)."""

    kind = "fp8"
    dtype = FP8

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                 act_dtype: torch.dtype, w8a8_rows: int | None = W8A8_ROWS) -> None:
        self.weight = weight.view(torch.float8_e4m3fn).contiguous()
        self.rows_count, self.cols = self.weight.shape
        bn, bk = block
        if bn >= self.rows_count and bk >= self.cols:  # one scale: the same as one per row
            scales = scales.reshape(1, 1).expand(self.rows_count, 1)
            bn, bk = 1, self.cols
        self.block = (bn, bk)
        self.scales = scales.to(torch.float32).contiguous()
        want = (-(-self.rows_count // bn), -(-self.cols // bk))
        if tuple(self.scales.shape) != want:
            raise ValueError(f"FP8 scales of shape {tuple(self.scales.shape)} for {self.rows_count} x {self.cols} "
                             f"in blocks {block}: expected {want}")
        self.act_dtype = act_dtype
        #: per-row scales (one per output channel): the layout ``torch._scaled_mm`` takes
        self.row_scales = self.scales.reshape(1, -1) if (bn, bk) == (1, self.cols) else None
        # torch._scaled_mm wants both dimensions of the weight in multiples of 16
        aligned = self.rows_count % 16 == 0 and self.cols % 16 == 0
        self.w8a8_rows = w8a8_rows if self.row_scales is not None and aligned else None
        self.gemv_rows = GEMV_ROWS

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4

    def dequantized(self) -> torch.Tensor:
        """The float32 matrix ``q · scale``."""
        bn, bk = self.block
        full = self.scales.repeat_interleave(bn, 0)[:self.rows_count].repeat_interleave(bk, 1)[:, :self.cols]
        return self.weight.float() * full

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.w8a8_rows is not None and x.shape[0] >= self.w8a8_rows:
            y = self.w8a8(x)
            return y if out is None else out.copy_(y)
        if 0 < x.shape[0] <= self.gemv_rows and x.is_cuda:
            return gemv.fp8_gemv(x.contiguous(), self.weight, self.scales, self.block, out)
        return fp8_matmul(x.contiguous(), self.weight, self.scales, self.block, out)

    def w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` with ``x`` quantized per row to e4m3 (scale ``amax/448``), through
        ``torch._scaled_mm`` with the weight's per-row scales; float32 accumulation. On CUDA the
        activations are quantized by one Triton launch (:func:`quantize_rows_e4m3`, the same
        bytes as the torch expression here, which takes six passes over them)."""
        if x.is_cuda:
            xq, x_scale = quantize_rows_e4m3(x)
        else:
            xf = x.float()
            x_scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp_(min=1e-12)
            xq = (xf / x_scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.row_scales, out_dtype=x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        bn, bk = self.block
        picked = self.weight.view(torch.uint8)[ids].view(torch.float8_e4m3fn).float()  # gathers as bytes
        scales = self.scales[ids // bn].repeat_interleave(bk, 1)[:, :self.cols]
        return (picked * scales).to(dtype or self.act_dtype)

    @staticmethod
    def concat(parts: list["FP8Matrix"]) -> "FP8Matrix":
        first = parts[0]
        weight = torch.cat([p.weight.view(torch.uint8) for p in parts])  # concatenated as bytes
        return FP8Matrix(weight, torch.cat([p.scales for p in parts]), first.block, first.act_dtype, first.w8a8_rows)

    def stacks_with(self, other: "FP8Matrix") -> bool:
        bn = self.block[0]
        return other.block == self.block and other.cols == self.cols and self.rows_count % bn == 0


DeviceMatrix = DenseMatrix | GGUFMatrix | FP8Matrix


def _on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A checkpoint array (often a read-only view of the mapped file) copied onto ``device``."""
    if device.type == "cpu":
        return torch.from_numpy(np.array(array, copy=True))
    with warnings.catch_warnings():  # read-only: torch only reads it, for the copy to the device
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).to(device)


def device_matrix(stored: StoredTensor, device: torch.device, act_dtype: torch.dtype,
                  quantization: str | None = None, w8a8_rows: int | None = W8A8_ROWS) -> DeviceMatrix:
    """``stored`` (a 2-D weight) on ``device`` in its stored form (see the module docstring);
    ``quantization="fp8"`` quantizes a f16/bf16/f32 matrix to e4m3 on the device first."""
    rows, cols = stored.shape
    if stored.dtype in GGUF_LAYOUTS and cols % GGUF_LAYOUTS[stored.dtype][1] == 0:
        data = _on_device(stored.data, device)
        return GGUFMatrix(stored.dtype, data, rows, cols, act_dtype)
    if stored.dtype == FP8:
        assert stored.scales is not None and stored.scale_block is not None
        weight = _on_device(stored.data, device).view(torch.float8_e4m3fn)
        scales = _on_device(stored.scales, device)
        return FP8Matrix(weight, scales, stored.scale_block, act_dtype, w8a8_rows)
    if stored.dtype in ("f32",) + HALF_DTYPES:
        values = _on_device(stored.data, device)
        if stored.dtype == "bf16":
            values = values.view(torch.bfloat16)
        if quantization == "fp8":
            q, scales = quantize_fp8(values)
            return FP8Matrix(q, scales, (1, cols), act_dtype, w8a8_rows)
        return DenseMatrix(values.to(act_dtype), stored.dtype)
    log.warning("%s: GGUF type %s has no CUDA kernel; decoded to %s at load", stored.name, stored.dtype,
                str(act_dtype).removeprefix("torch."))
    return DenseMatrix(torch.from_numpy(stored.to_float32()).to(device, act_dtype), stored.dtype)


def _stacks(last: DeviceMatrix, part: DeviceMatrix) -> bool:
    if type(last) is not type(part) or last.cols != part.cols or last.dtype != part.dtype:
        return False
    return not isinstance(last, FP8Matrix) or last.stacks_with(part)  # type: ignore[arg-type]


class MatrixGroup:
    """Matrices sharing one input (q/k/v/gate, gate/up): ``matmul`` returns their outputs
    side by side. Consecutive parts of one kind and type are stacked into one matrix (a
    uniform checkpoint runs one product per group; a Q4_K_M file's Q6_K v beside Q4_K
    q/k/gate runs three)."""

    def __init__(self, parts: list[DeviceMatrix]) -> None:
        merged: list[list[DeviceMatrix]] = []
        for part in parts:
            if merged and _stacks(merged[-1][-1], part):
                merged[-1].append(part)
            else:
                merged.append([part])
        self.parts: list[DeviceMatrix] = [run[0] if len(run) == 1 else type(run[0]).concat(run)  # type: ignore
                                          for run in merged]
        self.rows_count = sum(p.rows_count for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].matmul(x)
        return torch.cat([p.matmul(x) for p in self.parts], dim=1)


#: Row counts :func:`warm_products` runs: every tile size of
#: :func:`~musegl_cuda.cuda.quantized.product_tiles` with a row count that is not a multiple
#: of 16 (Triton compiles those apart), and a prefill-sized multiple of 16; the decode
#: graphs' widths (1, 2, 4 ... 128) compile their own at capture.
WARM_ROWS = (3, 17, 33, 65, 80)


def warm_products(matrices: list[DeviceMatrix], embedding: DeviceMatrix | None, rows=WARM_ROWS) -> int:
    """Run one product of each distinct kind of matrix (kind, type, shape) at each of
    ``rows``, and the embedding's gather, so that Triton compiles the launches a step can
    make before serving rather than under the first requests (the decode graphs compile
    only their own widths). Returns the number of products run."""
    seen: dict[tuple, DeviceMatrix] = {}
    for m in matrices:
        if not isinstance(m, DenseMatrix):
            seen.setdefault((type(m), m.dtype, m.rows_count, m.cols, getattr(m, "block", None)), m)
    launches = 0
    for matrix in seen.values():
        for count in rows:
            x = torch.zeros(count, matrix.cols, dtype=matrix.act_dtype, device=matrix_device(matrix))
            matrix.matmul(x)
            launches += 1
    if embedding is not None and not isinstance(embedding, DenseMatrix):
        for count in (1, 16, 17):
            embedding.rows(torch.zeros(count, dtype=torch.long, device=matrix_device(embedding)))
    return launches


def matrix_device(matrix: DeviceMatrix) -> torch.device:
    return matrix.data.device if isinstance(matrix, GGUFMatrix) else matrix.weight.device


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> str:
    """The GGUF type ``llama-quantize`` gives the matrix ``name`` (transformers name) in a
    Q4_K_M file: Q6_K for the head and for v_proj / down_proj of the layers
    ``use_more_bits`` picks, Q4_K for the rest."""
    if name == "lm_head.weight":
        return "q6_k"
    if name.endswith(("self_attn.v_proj.weight", "mlp.down_proj.weight")):
        return "q6_k" if _more_bits(int(name.split(".")[1]), layers) else "q4_k"
    return "q4_k"


#: ``random_matrix`` kinds besides the GGUF types: ``fp8`` and ``q4_k_m`` (Q4_K_M's types).
DUMMY_KINDS = ("fp8", "q4_k_m", *GGUF_LAYOUTS)


def random_matrix(name: str, rows: int, cols: int, kind: str, layers: int, device: torch.device,
                  act_dtype: torch.dtype, generator: torch.Generator, std: float,
                  w8a8_rows: int | None = W8A8_ROWS) -> DeviceMatrix:
    """A random matrix as stored, made on the device (``--load-format dummy`` with weights
    as stored: timing runs at a shape without a file). ``fp8``: N(0, std²) values quantized
    per row; a GGUF type (``q4_k_m``: :func:`q4_k_m_type`): random blocks whose float16
    ``d``/``dmin`` are a fixed small value (values within about ±0.3)."""
    if kind == "fp8":
        values = torch.empty(rows, cols, dtype=act_dtype, device=device).normal_(0.0, std, generator=generator)
        return FP8Matrix(*quantize_fp8(values), (1, cols), act_dtype, w8a8_rows)
    dtype = q4_k_m_type(name, layers) if kind == "q4_k_m" else kind
    _, vb, bb, _ = GGUF_LAYOUTS[dtype]
    raw = torch.randint(0, 256, (rows, cols // vb, bb), dtype=torch.uint8, device=device, generator=generator)
    small = torch.tensor([2e-4 if dtype in ("q4_k", "q5_k") else 2e-5 if dtype == "q6_k" else 5e-3],
                         dtype=torch.float16).view(torch.uint8).to(device)
    spots = {"q8_0": (0,), "q4_0": (0,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[dtype]
    for at in spots:
        raw[:, :, at:at + 2] = small
    return GGUFMatrix(dtype, raw.reshape(rows, -1), rows, cols, act_dtype)

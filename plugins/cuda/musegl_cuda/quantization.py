"""``--quantization fp8``: half-precision matrices quantized at load to float8 e4m3.

One scale per output row (``amax / 448``), float32. On CUDA the matrices stay
e4m3 on the device (:mod:`musegl_cuda.cuda.device_weights`); on the CPU they
are decoded back to float32 at load (``q · scale``, exact) and run by the
stored-weight kernels' float32 path, so a CPU run computes with exactly the
weights a GPU run holds. No Triton here: the CPU path imports this module.
"""

from __future__ import annotations

import torch

from musegl_core.checkpoint.stored import FP8, HALF_DTYPES, StoredTensor

#: ``--quantization`` values.
QUANTIZATIONS = ("fp8",)
#: float8 e4m3fn's largest finite value.
E4M3_MAX = 448.0


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weights, float32 scales (rows, 1))`` of a matrix, one scale per output row
    (``amax / 448``; an all-zero row gets scale 1)."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales


def quantized_stored(stored: StoredTensor) -> StoredTensor:
    """A f16/bf16/f32 matrix as an ``f8_e4m3`` :class:`StoredTensor` with one scale per
    output row (``--quantization fp8``); other tensors as they are."""
    if len(stored.shape) != 2 or stored.dtype not in ("f32",) + HALF_DTYPES:
        return stored
    q, scales = quantize_fp8(torch.from_numpy(stored.to_float32()))
    return StoredTensor(stored.name, FP8, stored.shape, q.view(torch.uint8).numpy(), scales=scales.numpy(),
                        scale_block=(1, stored.shape[1]))

"""Random stored-weight matrices (f32, f16, bf16, GGUF quantized) for the CPU kernel tests."""

from __future__ import annotations

import gguf
import numpy as np

from musegl_core.checkpoint.stored import StoredTensor


#: k-quant super-block bytes and where its f16 scale(s) sit (Q4_K/Q5_K: d and dmin first; Q6_K: d last).
K_QUANTS = {"q4_k": (144, 0), "q5_k": (176, 0), "q6_k": (210, 208)}


def stored_weight(dtype: str, n: int, k: int, seed: int = 0) -> StoredTensor:
    """An ``(n, k)`` matrix of standard-normal values stored as ``dtype``."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    if dtype == "f32":
        data = w
    elif dtype == "f16":
        data = w.astype(np.float16)
    elif dtype == "bf16":
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
    elif dtype in K_QUANTS:  # no quantizer in gguf-py: random super-blocks with small f16 d (and dmin)
        size, scales_at = K_QUANTS[dtype]
        blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        count = 2 if scales_at == 0 else 1
        blocks[:, :, scales_at:scales_at + 2 * count] = (
            rng.uniform(0.001, 0.01, size=(n, k // 256, count)).astype(np.float16).view(np.uint8))
        data = blocks.reshape(n, -1)
    else:
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[dtype.upper()])
    return StoredTensor("w", dtype, (n, k), data)

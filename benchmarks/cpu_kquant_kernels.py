"""Decode-size products of the CPU stored-weight kernels on k-quant weights, per kernel path.

For the bench model's gate/up (5632 x 1024) and down (1024 x 2816) shapes, 1 and 4
activation rows, one kernel thread: median milliseconds per product of
:class:`~musegl_cuda.cpu.stored_matrix.StoredMatrix` on f16, Q8_0 (baselines), Q4_K, Q5_K
and Q6_K weights, for every kernel path this CPU runs (avx512fp16, avx512, avx2), all in
one process and one run, so the figures are comparable as ratios only. k-quant blocks are
random bytes with small f16 scales (gguf-py has no k-quant quantizer; a product's time
does not depend on the values). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

import gguf
import numpy as np
import torch

from cpu_weight_kernels import median_ms
from musegl_core.checkpoint.stored import StoredTensor
from musegl_cuda.cpu import native
from musegl_cuda.cpu.stored_matrix import StoredMatrix

SHAPES = {"gate_up": (5632, 1024), "down": (1024, 2816)}
K_QUANTS = {"q4_k": (144, 0, 2), "q5_k": (176, 0, 2), "q6_k": (210, 208, 1)}  # bytes, scales at, f16 count


def weight(dtype: str, n: int, k: int, rng: np.random.Generator) -> StoredTensor:
    if dtype in K_QUANTS:
        size, at, count = K_QUANTS[dtype]
        blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
        blocks[:, :, at:at + 2 * count] = rng.uniform(0.001, 0.01, size=(n, k // 256, count)).astype(
            np.float16).view(np.uint8)
        return StoredTensor("w", dtype, (n, k), blocks.reshape(n, -1))
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    data = w.astype(np.float16) if dtype == "f16" else gguf.quants.quantize(w, gguf.GGMLQuantizationType[dtype.upper()])
    return StoredTensor("w", dtype, (n, k), data)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4")
    p.add_argument("--dtypes", default="f16,q8_0,q4_k,q5_k,q6_k")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    result: dict = {"cpu_paths": native.runnable_paths(), "threads": 1, "load_avg_at_start": os.getloadavg(),
                    "ms": {}}
    weights = {(name, dtype): weight(dtype, *shape, rng) for name, shape in SHAPES.items()
               for dtype in args.dtypes.split(",")}
    for path in native.runnable_paths():
        kernels = native.kernels(path)
        for (name, dtype), stored in weights.items():
            matrix = StoredMatrix.from_stored(stored, kernels)
            matrix.threads = 1
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, stored.shape[1])
                result["ms"][f"{path} {name}_x{rows} {dtype}"] = median_ms(lambda: matrix.matmul(x), args.repeats, 3)
    result["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

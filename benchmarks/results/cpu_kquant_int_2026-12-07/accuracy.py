"""Error of the k-quant products, float kernels (MUSEGL_CPU_KQUANT=float) against the integer ones
(int), per kernel path: each output's |y - exact| / sqrt(sum_k (w x)^2), exact = the float64
product of gguf-py's dequantized weights (exact in float32 for Q6_K; Q4_K/Q5_K's d*sc*n - dmin*min
rounded once, as every float kernel sees it) and the float32 activations.
python accuracy.py [ROWS]"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins/cuda/tests"))
from stored_weights_support import stored_weight  # noqa: E402

from musegl_cuda.cpu import native  # noqa: E402
from musegl_cuda.cpu.stored_matrix import StoredMatrix  # noqa: E402

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16
g = torch.Generator().manual_seed(3)
inputs = {
    "randn": torch.randn(rows, 2048, generator=g),
    # a few large values per row (post-norm activations' outliers): per-block scales set by them
    "outliers": torch.randn(rows, 2048, generator=g) * torch.where(torch.rand(rows, 2048, generator=g) < 0.01, 100.0, 1.0),
}
for dtype in ("q4_k", "q5_k", "q6_k"):
    stored = stored_weight(dtype, 512, 2048, seed=7)
    w = torch.from_numpy(stored.to_float32()).double()
    for name, x in inputs.items():
        exact = x.double() @ w.T
        scale = (x.double().pow(2) @ w.pow(2).T).sqrt()
        for path in native.runnable_paths():
            line = []
            for mode in native.KQUANT_MODES:
                y = StoredMatrix.from_stored(stored, native.kernels(path, mode)).matmul(x)
                err = (y.double() - exact).abs() / scale
                line.append(f"{mode}: mean {float(err.mean()):.2e} max {float(err.max()):.2e}")
            print(f"{dtype} 512x2048 x {rows} rows ({name}) {path:10s} " + "  |  ".join(line), flush=True)

"""Decode-size matrix products on the CPU: torch's kernels vs musegl's stored-weight kernels.

For the bench model's shapes (the 202048 x 1024 head, the 5632 x 1024 gate/up
and the 1024 x 2816 down projection) and 1 and 4 activation rows, times in the
same run: torch float32 (``(W @ x^T)^T``, the torch-cpu float32 path), torch
bfloat16/float16 ``F.linear`` (oneDNN), oneDNN with a prepacked bfloat16 weight,
torch's weight-only int8 (``_weight_int8pack_mm``, one scale per row) and int4
(``_weight_int4pack_mm_for_cpu``, 32-value groups: Q4_0's layout) kernels, and
:class:`~musegl_cuda.cpu.stored_matrix.StoredMatrix` on f16, bf16, Q8_0 and Q4_0
weights. Prints one JSON object: median milliseconds per product.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from musegl_core.checkpoint.stored import StoredTensor
from musegl_cuda.cpu.stored_matrix import StoredMatrix

SHAPES = {"head": (202048, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}


def median_ms(fn, repeats: int, digits: int = 2) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (after one warm-up call), in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, digits)


def stored(w: np.ndarray, dtype: str) -> StoredMatrix:
    if dtype == "f16":
        data = w.astype(np.float16)
    elif dtype == "bf16":
        data = (w.view(np.uint32) >> 16).astype(np.uint16)
    else:
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[dtype.upper()])
    return StoredMatrix.from_stored(StoredTensor("w", dtype, w.shape, data))


def candidates(w: np.ndarray, rows: int) -> dict:
    n, k = w.shape
    w32 = torch.from_numpy(w)
    wb, wh = w32.bfloat16(), w32.half()
    packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(wb, rows)
    scale = w32.abs().amax(1) / 127
    q8 = torch.round(w32 / scale[:, None]).to(torch.int8)
    groups = w32.view(n, k // 32, 32)
    d = groups.abs().amax(-1) / 8
    q4 = torch.clamp(torch.round(groups / d[..., None]) + 8, 0, 15).to(torch.int32).view(n, k)
    q4_packed = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    scales_zeros = torch.stack([d.t(), torch.zeros_like(d.t())], -1).contiguous().bfloat16()
    ours = {dtype: stored(w, dtype) for dtype in ("f16", "bf16", "q8_0", "q4_0")}
    x = torch.randn(rows, k)
    xb, xh = x.bfloat16(), x.half()
    out = {
        "torch_f32": lambda: (w32 @ x.t()).t(),
        "torch_bf16_linear": lambda: F.linear(xb, wb),
        "torch_f16_linear": lambda: F.linear(xh, wh),
        "onednn_bf16_prepacked": lambda: torch.ops.mkldnn._linear_pointwise(xb, packed_bf16, None, "none", [], ""),
        "torch_int8pack_bf16": lambda: torch._weight_int8pack_mm(xb, q8, scale.bfloat16()),
        "torch_int4pack_bf16": lambda: torch._weight_int4pack_mm_for_cpu(xb, q4_packed, 32, scales_zeros),
    }
    for dtype, matrix in ours.items():
        out[f"musegl_{dtype}"] = lambda matrix=matrix: matrix.matmul(x)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    result: dict = {"threads": torch.get_num_threads(), "load_avg_at_start": os.getloadavg(), "ms": {}}
    for name in args.shapes.split(","):
        w = (rng.standard_normal(SHAPES[name]) * 0.02).astype(np.float32)
        for rows in map(int, args.rows.split(",")):
            result["ms"][f"{name}_x{rows}"] = {label: median_ms(fn, args.repeats)
                                              for label, fn in candidates(w, rows).items()}
    result["load_avg_at_end"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

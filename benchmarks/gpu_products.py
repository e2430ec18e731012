"""The decoder's four weight products alone, at the 30B shape: how fast each way of computing them is.

For each product of a layer (q/k/v/gate, output, gate/up, down) and each row
count (``--rows``, default 1 and 64), 52 launches over 52 different weight
matrices (one per layer, so nothing is served from L2 that a real step reads
from memory) are captured in one CUDA graph; one JSON line per way gives the
microseconds per launch and the weight bytes streamed per second:

* ``linear``: ``F.linear`` (cuBLAS; the executor's way, no cuBLAS workspace,
  so no split-K);
* ``splitK``: the depth split in K parts computed as one strided batched
  product (``torch.bmm`` over views, no copies), the parts summed in float32.

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # as the executor runs them

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def split_k(x: torch.Tensor, w: torch.Tensor, parts: int) -> torch.Tensor:
    """``x @ w.T`` with the depth in ``parts`` slices, one batched launch, summed in float32."""
    m, k = x.shape
    n = w.shape[0]
    d = k // parts
    xs = x.view(m, parts, d).permute(1, 0, 2)  # (parts, m, d)
    ws = w.view(n, parts, d).permute(1, 2, 0)  # (parts, d, n)
    return torch.bmm(xs, ws).sum(0, dtype=torch.float32).to(x.dtype)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,64")
    p.add_argument("--layers", type=int, default=52)
    p.add_argument("--parts", default="2,3,4")
    args = p.parse_args()
    from gpu_decode import text_config
    from gpu_kernel_probe import graph_us

    c = text_config(argparse.Namespace(config=None)).config
    q = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    shapes = {"qkvg": (2 * q + 2 * kv, c.hidden_size), "output": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    emit(part="setup", device=torch.cuda.get_device_name(), torch=torch.__version__,
         shapes={k: list(v) for k, v in shapes.items()})
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ways = {"linear": lambda w: F.linear(x, w)}
            for parts in (int(s) for s in args.parts.split(",")):
                if k % parts == 0:
                    ways[f"split{parts}"] = lambda w, parts=parts: split_k(x, w, parts)
            reference = F.linear(x, weights[0]).float()
            for way, fn in ways.items():
                err = (fn(weights[0]).float() - reference).abs().max().item()
                us = graph_us(lambda: [fn(w) for w in weights]) / len(weights)
                emit(part="product", product=name, rows=m, way=way, us=round(us, 2),
                     tb_s=round(n * k * 2 / us / 1e6, 2), max_diff=round(err, 4))
        del weights
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

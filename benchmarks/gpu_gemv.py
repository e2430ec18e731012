"""Skinny weight products as a Triton kernel, against cuBLAS: is there a faster way to stream the weights?

The decode step's four weight products (q/k/v/gate, output, gate/up, down) at
1, 8 and 64 rows are bound by the weight bytes they stream. cuBLAS, as torch
calls it, streams them at 3.1-4.1 TB/s (``gpu_products.py``); each launch
also loses a few microseconds to its ramp and tail. This probe times, the way
``gpu_products.py`` does (52 launches over 52 different matrices in one CUDA
graph, so every launch reads its weights from memory):

* ``linear``: ``F.linear`` (cuBLAS, no workspace, as the executor runs it);
* ``triton``: :func:`skinny_product`, one program per ``block_n`` output
  columns looping over the depth, rows padded to 16 for the tensor cores,
  for every setting of a small sweep (the best one is printed, plus
  ``--all`` for every setting);
* ``triton_pdl``: the best setting launched with programmatic dependent
  launch: the program loads its first weight tile, *then* waits for the
  kernel before it (whose output is its input rows), so a launch's ramp
  overlaps the previous launch's tail.

One JSON line per (product, rows, way): microseconds per launch, TB/s of
weights streamed, the largest difference from ``F.linear`` in float32.

``--check`` runs the kernel against ``F.linear`` on small shapes, on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``) or on a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")  # as the executor runs them

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


@triton.jit
def _skinny_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   STAGES: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_rows = W + offs_n[:, None] * stride_wn
    # the first weight tile does not depend on the kernel before: load it before waiting
    w0 = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x0 = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K),
                 other=0.0)
    acc = tl.dot(x0, tl.trans(w0))
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + offs_k
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks[None, :] < K), other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def skinny_product(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256, warps: int = 4,
                   stages: int = 4, pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T`` for few rows (``x``: (m, k), m <= 64; ``w``: (n, k), both contiguous in k)."""
    m, k = x.shape
    n = w.shape[0]
    if m > 64:
        raise ValueError(f"skinny_product takes at most 64 rows, got {m}")
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    extra = {"launch_pdl": True} if pdl else {}
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, PDL=pdl,
        num_warps=warps, num_stages=stages, **extra)
    return y


SWEEP = dict(block_n=(16, 32, 64), block_k=(128, 256), warps=(4, 8), stages=(3, 5))


def check() -> int:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    failures = 0
    for m, n, k in ((1, 40, 96), (5, 70, 300), (17, 33, 64), (64, 48, 520)):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        want = F.linear(x.float(), w.float())
        for block_n, block_k in ((16, 64), (32, 128)):
            got = skinny_product(x, w, block_n=block_n, block_k=block_k, stages=2).float()
            err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
            ok = err < (2e-2 if dtype == torch.bfloat16 else 1e-4)
            failures += not ok
            emit(part="check", m=m, n=n, k=k, block_n=block_n, block_k=block_k, rel_err=err, ok=ok)
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--layers", type=int, default=52)
    p.add_argument("--all", action="store_true", help="print every sweep setting, not only the best")
    p.add_argument("--check", action="store_true", help="correctness against F.linear on small shapes, then exit")
    args = p.parse_args()
    if args.check:
        return check()
    from gpu_decode import text_config
    from gpu_kernel_probe import graph_us

    c = text_config(argparse.Namespace(config=None, tiny=False, layers=None)).config
    q = c.num_heads * c.head_dim
    kv = c.num_kv_heads * c.head_dim
    shapes = {"qkvg": (2 * q + 2 * kv, c.hidden_size), "output": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    emit(part="setup", device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
         shapes={name: list(s) for name, s in shapes.items()})
    settings = [dict(zip(SWEEP, values)) for values in itertools.product(*SWEEP.values())]
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.layers)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            reference = F.linear(x, weights[0]).float()

            def record(way, us, err, **extra):
                emit(part="product", product=name, rows=m, way=way, us=round(us, 2),
                     tb_s=round(n * k * 2 / us / 1e6, 2), max_diff=round(err, 4), **extra)

            us = graph_us(lambda: [F.linear(x, w) for w in weights]) / len(weights)
            record("linear", us, 0.0)
            best = None
            for s in settings:
                try:
                    err = (skinny_product(x, weights[0], **s).float() - reference).abs().max().item()
                    us = graph_us(lambda s=s: [skinny_product(x, w, out=o, **s) for w, o in zip(weights, outs)])
                except Exception as exc:  # a setting that does not compile or fit is skipped
                    emit(part="product", product=name, rows=m, way="triton", setting=s, error=str(exc)[:200])
                    continue
                us /= len(weights)
                if args.all:
                    record("triton_setting", us, err, setting=s)
                if best is None or us < best[0]:
                    best = (us, err, s)
            if best is None:
                continue
            record("triton", best[0], best[1], setting=best[2])
            s = best[2]
            try:
                err = (skinny_product(x, weights[0], pdl=True, **s).float() - reference).abs().max().item()
                us = graph_us(lambda: [skinny_product(x, w, out=o, pdl=True, **s) for w, o in zip(weights, outs)])
                record("triton_pdl", us / len(weights), err, setting=s)
            except Exception as exc:
                emit(part="product", product=name, rows=m, way="triton_pdl", error=str(exc)[:200])
        weights = []
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

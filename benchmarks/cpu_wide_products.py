"""Prompt-sized float32 kernel products against torch's float32 GEMM (MKL), in CPU time.

For one shape and row count, times (``time.thread_time``, one thread, so a shared
machine disturbs it little) the stored-weight kernels' float32 product of an f16
matrix (``StoredMatrix._exact``: the wide products prefill runs off AVX512-FP16, and
every path's sampled rows) and ``F.linear`` on the same weights decoded to float32,
alternating, for ``--rounds`` rounds. ``--old-source`` adds the same product built from
another version of ``weight_kernels.c`` (``git show REV:plugins/cuda/musegl_cuda/cpu/
weight_kernels.c > old.c``) and ``--define`` builds of this source with extra ``-D``
flags (its ``#ifndef`` tunables: NR_WIDE, MR_WIDE, BLOCK_X_BYTES, K_SLICE_BYTES ...).
Prints one JSON line: per variant, the ratio to torch's time in each round, and the median.

    python benchmarks/cpu_wide_products.py --path avx512 --rows 512 --shape 1024x2816
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from musegl_cuda.cpu import native
from musegl_cuda.cpu.stored_matrix import StoredMatrix


def build(path: str, source: Path, defines: list[str]) -> native.Kernels:
    p = native.path_named(path)
    variant = native.KernelPath(p.name, p.cpu_flags, p.code, p.summary,
                                disable=p.disable + tuple(("", f"-D{d}") for d in defines))
    saved, native.SOURCE = native.SOURCE, source
    try:
        built = native._build(variant)
    finally:
        native.SOURCE = saved
    if isinstance(built, str):
        raise SystemExit(built)
    return built


def cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=native.runnable_paths()[0] if native.runnable_paths() else "avx2")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--shape", default="5632x1024", help="weight rows x columns")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--old-source", type=Path, default=None)
    p.add_argument("--define", action="append", default=[], help="NAME=VALUE (repeatable: one variant each)")
    args = p.parse_args()
    torch.set_num_threads(1)
    n, k = map(int, args.shape.split("x"))
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02).half()
    x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(1))
    data = w.view(torch.uint8).reshape(n, -1).contiguous()
    variants = {"current": build(args.path, native.SOURCE, [])}
    if args.old_source:
        variants["old_source"] = build(args.path, args.old_source, [])
    for d in args.define:
        variants[d] = build(args.path, native.SOURCE, d.split(","))
    mats = {name: StoredMatrix("f16", data, n, k, threads=1, kernels=kern) for name, kern in variants.items()}
    w32 = w.float()
    for mat in mats.values():  # a variant that computes something else is no variant
        torch.testing.assert_close(mat._exact(x), F.linear(x, w32), rtol=1e-3, atol=1e-3)
    ratios: dict[str, list[float]] = {name: [] for name in mats}
    for _ in range(args.rounds):
        base = cpu_ms(lambda: F.linear(x, w32), args.repeats)
        for name, mat in mats.items():
            ratios[name].append(round(cpu_ms(lambda mat=mat: mat._exact(x), args.repeats) / base, 3))
    print(json.dumps({"path": args.path, "rows": args.rows, "shape": [n, k], "rounds": args.rounds,
                      "baseline": "torch F.linear float32 (MKL), one thread, CPU time, same process",
                      "ratio_to_torch": ratios,
                      "median": {name: statistics.median(r) for name, r in ratios.items()},
                      "load_avg": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

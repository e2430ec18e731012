"""Where a decode step's time goes: musegl's torch-cpu executor, one sequence, on the given file.

Runs a 64-token prompt, then ``--steps`` decode steps of one row, with torch and the
stored-weight kernels on ``--threads`` threads; times (wall) every ``StoredMatrix`` product
and the whole step. Prints one JSON object: the median step (wall and process CPU time),
the time in the products, and per product shape. Environment as given (``OMP_WAIT_POLICY``,
``MUSEGL_CPU_KERNELS``).

    python benchmarks/cpu_step_profile.py --model FILE [--threads 2] [--steps 24] [--torch-threads N]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-threads", type=int, default=None, help="torch's threads after loading (default: --threads)")
    p.add_argument("--steps", type=int, default=24)
    args = p.parse_args()
    torch.set_num_threads(args.threads)  # the kernels' pool takes torch's count at its first call
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cpu import native, stored_matrix
    from musegl_cuda.executor import TorchExecutor

    per_shape: dict = collections.defaultdict(float)
    current = {"products": 0.0}
    original = stored_matrix.StoredMatrix._exact

    def timed(self, x):
        start = time.perf_counter()
        y = original(self, x)
        spent = time.perf_counter() - start
        current["products"] += spent
        per_shape[f"{self.dtype} {self.rows}x{self.cols}"] += spent
        return y

    stored_matrix.StoredMatrix._exact = timed
    blocks = -(-(64 + args.steps) // 16)
    ex = TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=16)
    ex.allocate_kv(blocks)
    table = list(range(blocks))

    def chunk(tokens, start):
        return SeqChunk(seq=0, tokens=tokens, positions=list(range(start, start + len(tokens))), blocks=table,
                        sample=True)

    ex.step(Step([chunk(list(range(5, 69)), 0)]))
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    walls, cpus, products = [], [], []
    for i in range(args.steps):
        if i == 2:
            per_shape.clear()
        current["products"] = 0.0
        w0, c0 = time.perf_counter(), time.process_time()
        ex.step(Step([chunk([5 + i], 64 + i)]))
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        products.append(current["products"])
    n = args.steps - 2
    print(json.dumps({
        "model": str(args.model), "kernel_path": native.selected_path(), "threads": args.threads,
        "torch_threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "step_wall_ms_median": round(statistics.median(walls[2:]) * 1e3, 2),
        "step_process_cpu_ms_median": round(statistics.median(cpus[2:]) * 1e3, 2),
        "products_wall_ms_median": round(statistics.median(products[2:]) * 1e3, 2),
        "per_shape_wall_ms_mean": {k: round(v / n * 1e3, 3) for k, v in sorted(per_shape.items(), key=lambda kv: -kv[1])},
        "load_avg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

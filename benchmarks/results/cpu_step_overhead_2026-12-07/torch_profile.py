"""torch.profiler over decode steps of one sequence in the torch-cpu executor (where the time
outside the stored-weight products goes).

    python torch_profile.py --model FILE [--threads 2] [--steps 20] [--rows 40]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--sort", default="self_cpu_time_total")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    blocks = -(-(64 + args.steps + 4) // 16)
    ex = TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=16)
    ex.allocate_kv(blocks)
    table = list(range(blocks))

    def chunk(tokens, start):
        return SeqChunk(seq=0, tokens=tokens, positions=list(range(start, start + len(tokens))), blocks=table,
                        sample=True)

    ex.step(Step([chunk(list(range(5, 69)), 0)]))
    for i in range(3):
        ex.step(Step([chunk([5 + i], 64 + i)]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(3, 3 + args.steps):
            ex.step(Step([chunk([5 + i], 64 + i)]))
        wall = time.perf_counter() - t0
    print(f"steps {args.steps}, wall per step {wall / args.steps * 1e3:.2f} ms (under the profiler)")
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

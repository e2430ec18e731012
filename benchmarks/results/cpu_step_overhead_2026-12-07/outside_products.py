"""A decode step's time outside the stored-weight products: the torch-cpu executor, one
sequence of ``--context`` prompt tokens on ``--model``, ``--steps`` plain-greedy decode steps
of one row (``SeqChunk`` defaults: greedy, no logits asked).

Every ``StoredMatrix._exact`` product is bracketed; per step the step's time, the products'
time and the difference ("outside") are taken, and their medians printed as one JSON line.
``--clock thread`` (default): ``time.thread_time`` with torch and the kernels on one thread,
so all the step's work is on the calling thread's clock and another process on the machine
disturbs it little (the products, memory-bound, still move with the other's memory traffic:
hence "outside", which holds the glue this folder is about). ``--clock wall``: wall time,
for ``--threads 2``.

Runs against whatever ``musegl_cuda`` is imported: ``PYTHONPATH=BASE:BASE/plugins/cuda``
runs a base tree (``ab.sh``).

    python outside_products.py --model FILE [--threads 1] [--steps 40] [--context 64] [--clock thread]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--sequences", type=int, default=1)
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import musegl_cuda
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cpu import native, stored_matrix
    from musegl_cuda.executor import TorchExecutor

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    spent = [0.0]
    original = stored_matrix.StoredMatrix._exact

    def timed(self, x):
        start = clock()
        try:
            return original(self, x)
        finally:
            spent[0] += clock() - start

    stored_matrix.StoredMatrix._exact = timed
    blocks = -(-(args.context + args.steps + 1) // 16)
    ex = TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=16)
    ex.allocate_kv(blocks * args.sequences)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(args.sequences)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, ex.config.vocab_size, (args.context,), generator=g).tolist()
               for _ in range(args.sequences)]
    for s in range(args.sequences):
        ex.step(Step([SeqChunk(seq=s, tokens=prompts[s], positions=list(range(args.context)), blocks=tables[s],
                               sample=True)]))
    steps, products, outside = [], [], []
    last = [5] * args.sequences
    for i in range(args.steps):
        spent[0] = 0.0
        start = clock()
        out = ex.step(Step([SeqChunk(seq=s, tokens=[last[s]], positions=[args.context + i], blocks=tables[s],
                                     sample=True) for s in range(args.sequences)]))
        total = clock() - start
        last = [out.tokens[s][-1] for s in range(args.sequences)]
        steps.append(total)
        products.append(spent[0])
        outside.append(total - spent[0])
    keep = slice(3, None)
    ms = lambda xs: round(statistics.median(xs[keep]) * 1e3, 3)  # noqa: E731
    print(json.dumps({"tree": str(Path(musegl_cuda.__file__).parents[2]), "model": args.model.name,
                      "kernel_path": native.selected_path(), "threads": args.threads, "clock": args.clock,
                      "sequences": args.sequences, "context": args.context,
                      "step_ms": ms(steps), "products_ms": ms(products), "outside_ms": ms(outside),
                      "outside_ms_min": round(min(outside[keep]) * 1e3, 3), "tokens": last,
                      "load_avg": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The cost of a speculative verify step relative to a decode step, on a GPU.

Builds the torch executor at the 30B shape (or ``--config``) with dummy
weights, prefills one sequence to ``--context`` positions, then times, at
batch 1, a decode step (1 row, 1 sampled id) and a verify step (the pending
token and N drafts: N+1 rows, N+1 sampled ids, as DFlash sends it), each
through the executor's captured graph for its width when there is one. Prints
JSON lines and the ratio verify/decode (DFlash target: <= 1.3 for N = 15).

    python benchmarks/verify_cost.py --drafts 15
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

from gpu_decode import text_config, timed
from musegl_core.engine.executor import SeqChunk, Step
from musegl_cuda.executor import TorchExecutor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a config.json (default: the 30B shape)")
    p.add_argument("--drafts", type=int, default=15)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--repeat", type=int, default=30)
    args = p.parse_args()
    checkpoint = text_config(args)
    c = checkpoint.config
    rows = args.drafts + 1
    executor = TorchExecutor(checkpoint, device="cuda", dtype="bfloat16", dummy_seed=0, forward_sizes=(1, rows))
    bs = executor.block_size
    blocks = list(range(-(-(args.context + rows + 1) // bs)))
    executor.allocate_kv(len(blocks) + 4)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, c.vocab_size, size=args.context).tolist()
    executor.step(Step([SeqChunk(0, prompt, list(range(args.context)), blocks, sample=1)]))
    pos = args.context
    ids = rng.integers(4, c.vocab_size, size=rows).tolist()
    decode = Step([SeqChunk(0, ids[:1], [pos], blocks, sample=1)], width=1)
    verify = Step([SeqChunk(0, ids, list(range(pos, pos + rows)), blocks, sample=rows)], width=rows)
    figures = {}
    for name, step in (("decode", decode), ("verify", verify)):
        times = timed(lambda step=step: executor.step(step), args.repeat + 3)[3:]
        figures[name] = statistics.median(times) * 1e3
        print(json.dumps({"figure": name, "rows": len(step.chunks[0].tokens), "context": args.context,
                          "graph": step.width in executor.limits.step_sizes,
                          "ms_per_step": round(figures[name], 2)}), flush=True)
    print(json.dumps({"figure": "verify_over_decode", "drafts": args.drafts,
                      "ratio": round(figures["verify"] / figures["decode"], 3), "target": 1.3}), flush=True)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

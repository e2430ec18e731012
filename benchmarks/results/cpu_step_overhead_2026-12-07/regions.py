"""Where a decode step's time goes, by region (wall, exclusive of nested regions): the torch-cpu
executor, one sequence on ``--model``, ``--steps`` decode steps after a 64-token prompt.

Every region is a function of the executor or the model wrapped with ``time.perf_counter``
(a stack, so a region's figure excludes the regions it calls; "step (rest)" is what the
executor's ``step`` did outside every named region). Medians over steps of each region's sum
per step, and the median step. The wrapping costs ~1 us a call.

    python regions.py --model FILE [--threads 2] [--steps 40]
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
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: time.thread_time (the calling thread's CPU time; with --threads 1 every "
                        "op runs on it, so a loaded machine disturbs it little)")
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(args.threads)
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda import executor as executor_mod
    from musegl_cuda import model as model_mod
    from musegl_cuda import sampling, pending
    from musegl_cuda.cpu import attention, stored_matrix
    from musegl_cuda.executor import TorchExecutor

    spent: dict = collections.defaultdict(float)
    stack: list = []

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def timed(*a, **k):
            now = clock()
            if stack:
                spent[stack[-1][0]] += now - stack[-1][1]
            stack.append([label, now])
            try:
                return original(*a, **k)
            finally:
                end = clock()
                lab, start = stack.pop()
                spent[lab] += end - start
                if stack:
                    stack[-1][1] = end

        setattr(owner, name, timed)

    M = model_mod
    wrap(TorchExecutor, "step", "step (rest)")
    wrap(TorchExecutor, "_decode_batch", "executor: decode batch (tables, slots)")
    wrap(TorchExecutor, "_outputs", "executor: _outputs glue")
    if hasattr(TorchExecutor, "_eager_outputs"):  # after the greedy change
        wrap(TorchExecutor, "_eager_outputs", "executor: _eager_outputs glue")
        wrap(M.MuseGlimmerDecoder, "greedy_ids", "head: greedy ids (scale)")
        wrap(M, "capped_argmax", "head: capped_argmax")
    wrap(M.MuseGlimmerDecoder, "forward", "model: embed, rope, final norm, layer loop")
    wrap(M.MuseGlimmerDecoder, "logits", "head: softcap chain")
    wrap(M.DecoderLayer, "forward", "layer: residual adds")
    wrap(M.CenteredRMSNorm, "forward", "layer: centered norms (4)")
    wrap(M.Attention, "forward", "attn: split, qk norm, rope, kv write, gate")
    wrap(M.MLP, "forward", "mlp: silu * up")
    wrap(M, "attention_rows", "attn: mw_attention + row keys")
    wrap(stored_matrix.StoredMatrix, "matmul", "products (StoredMatrix.matmul)")
    wrap(stored_matrix.StoredGroup, "matmul", "products: group cat")
    wrap(executor_mod, "choose", "sampler: choose (argmax)")
    wrap(pending.Sampled, "_read", "read: ids to lists, StepOutput")
    wrap(M.MuseGlimmerDecoder, "embed", "model: embed (rows + norm)")
    wrap(M.RotaryEmbedding, "forward", "model: rope tables")
    wrap(M, "plain_rms_norm", "plain rms norms (qk, final)")
    try:
        from musegl_cuda.cpu import row_norms
        wrap(row_norms.RowNorms, "norm", "C norms")
        wrap(row_norms.RowNorms, "add_norm", "C residual add + norms")
    except ImportError:
        pass
    wrap(M, "apply_rope", "attn: apply_rope")
    wrap(M, "write_rows", "attn: kv write_rows")

    blocks = -(-(64 + args.steps + 4) // 16)
    ex = TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=16)
    ex.allocate_kv(blocks)
    table = list(range(blocks))

    def chunk(tokens, start):
        return SeqChunk(seq=0, tokens=tokens, positions=list(range(start, start + len(tokens))), blocks=table,
                        sample=True)

    ex.step(Step([chunk(list(range(5, 69)), 0)]))
    per_step, walls = [], []
    for i in range(args.steps):
        spent.clear()
        w0 = clock()
        ex.step(Step([chunk([5 + i], 64 + i)]))
        walls.append(clock() - w0)
        per_step.append(dict(spent))
    keep = per_step[3:]
    labels = sorted({k for s in keep for k in s}, key=lambda k: -statistics.median(s.get(k, 0) for s in keep))
    out = {"model": str(args.model), "threads": args.threads, "clock": args.clock,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "step_ms_median": round(statistics.median(walls[3:]) * 1e3, 3),
           "regions_ms_median": {k: round(statistics.median(s.get(k, 0) for s in keep) * 1e3, 3) for k in labels},
           "load_avg": os.getloadavg()}
    out["outside_products_ms"] = round(sum(v for k, v in out["regions_ms_median"].items()
                                           if not k.startswith("products (")), 3)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

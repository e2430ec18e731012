"""Host time of staging CUDA graph steps at long contexts (CPU only: no GPU needed).

Measures, in one run, the host's share of a decode step that the CUDA graphs
do not hide (``musegl_cuda.cuda.graphs`` and ``musegl_cuda.cuda.sampling_graphs`` built on
CPU tensors, where the copies are plain memcpy):

* ``tables``: staging ``--batch`` sequences at ``--context`` positions, one row
  each (``stage_decode``) and verify blocks of ``--draft + 1`` rows
  (``stage_rows``), against the planned staging verify blocks took before
  (``plan_step`` + ``stage_plan``: every table converted and sent each step);
* ``sampler``: the host work of a decode step of ``--batch`` rows under grammar
  masks and a penalty at the 30B vocabulary, histories of ``--context`` ids
  growing by one a step: the sampler graphs' (``PenaltyCounts.assign``, which
  adds the new ids, and ``SamplerInputs.stage``) against the eager sampler's
  host arrays (``unpack_masks`` + ``penalty_counts``).

Figures are medians in milliseconds and ratios to the baseline of the same
run. ``python benchmarks/graph_staging.py --context 4096 --steps 8`` runs in
seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from musegl_core.engine.executor import SamplingParams, SeqChunk, Step
from musegl_core.engine.sample_rows import SampleRows, penalty_counts, unpack_masks
from musegl_cuda.cuda.graphs import DecodeGraphs
from musegl_cuda.cuda.plan import plan_step
from musegl_cuda.cuda.penalty_counts import PenaltyCounts
from musegl_cuda.cuda.sampling_graphs import SamplerInputs


def median_ms(fn, steps: int) -> float:
    times = []
    for s in range(steps):
        t = time.perf_counter()
        fn(s)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def tables_part(args) -> dict:
    bs, batch, rows = 16, args.batch, args.draft + 1
    cols = -(-(args.context + rows * args.steps + 64) // bs)
    nb = batch * cols + 8
    rng = np.random.default_rng(0)
    order = rng.permutation(nb).tolist()
    tables = [order[i * cols:(i + 1) * cols] for i in range(batch)]
    width = 1 << (batch * rows - 1).bit_length()

    def graphs() -> DecodeGraphs:
        g = DecodeGraphs(None, torch.zeros(1), (width,), bs, cols, 16, 1)
        g.reset(nb)
        return g

    def chunks(s: int, k: int) -> list[SeqChunk]:
        start = args.context + s * k
        return [SeqChunk(i, [5] * k, list(range(start, start + k)), list(tables[i]), sample=k) for i in range(batch)]

    g = graphs()
    decode = median_ms(lambda s: g.stage_decode(chunks(s, 1), width, nb, 1000), args.steps)
    g = graphs()
    staged = median_ms(lambda s: g.stage_rows(chunks(s, rows), width, nb, 1000, 1), args.steps)
    g = graphs()

    def planned(s: int) -> None:
        g.stage_plan(plan_step(Step(chunks(s, rows), width=width), bs, nb, 1000, 1, width=width, scratch_block=nb,
                               num_tiles=width))

    before = median_ms(planned, args.steps)
    return {"figure": "tables", "context": args.context, "batch": batch, "verify_rows": rows,
            "plan_stage_ms": round(before, 3), "stage_rows_ms": round(staged, 3), "stage_decode_ms": round(decode, 3),
            "stage_rows_vs_plan": round(staged / before, 4), "stage_decode_vs_plan": round(decode / before, 4)}


def sampler_part(args) -> dict:
    vocab, batch = args.vocab, args.batch
    rng = np.random.default_rng(1)
    words = -(-vocab // 32)
    histories = [rng.integers(0, vocab, size=args.context).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.7, top_p=0.9, frequency_penalty=0.3, seed=1)
    masks = [rng.integers(0, 2**32, size=words, dtype=np.uint32) for _ in range(batch)]

    def rows_at(s: int) -> SampleRows:
        """Step ``s``: every history one id longer than at step ``s - 1``, as decoding makes it."""
        step = Step([SeqChunk(i, [histories[i][args.context + s]], [args.context + s], [0], sample=1,
                              sampling=params, uniforms=[0.5],
                              masks=[masks[i]], history=histories[i][:args.context + s],
                              prompt_len=args.context // 2, logprobs=5) for i in range(batch)])
        return SampleRows.of(step)

    for h in histories:
        h.extend(rng.integers(0, vocab, size=args.steps + 1).tolist())
    counts = PenaltyCounts(batch, vocab, torch.device("cpu"))
    inputs = SamplerInputs(batch, vocab, torch.device("cpu"), zero_slot=counts.zero)
    staged_rows = [rows_at(s) for s in range(args.steps)]

    def eager(s: int) -> None:
        rows = staged_rows[s]
        unpack_masks(rows.masks, vocab)
        penalty_counts(rows, rows.penalized, vocab)

    def graph(s: int) -> None:
        rows = staged_rows[s]
        slots = counts.assign(list(range(batch)), rows.counted)
        inputs.stage(rows, batch, slots)

    graph(0)  # the first step counts every history once; the figure is for the steps after it
    before = median_ms(eager, args.steps)
    staged = median_ms(lambda s: graph(s + 1) if s + 1 < args.steps else graph(s), args.steps)
    return {"figure": "sampler", "vocab": vocab, "batch": batch, "history": args.context,
            "eager_host_ms": round(before, 3), "graph_stage_ms": round(staged, 3),
            "graph_stage_vs_eager": round(staged / before, 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=131000, help="positions of each sequence")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--draft", type=int, default=3, help="drafts per verify block")
    p.add_argument("--vocab", type=int, default=202048)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(1)  # the CPU tensors' copies stand for DMA: memcpy, not a woken thread pool
    for part in (tables_part, sampler_part):
        print(json.dumps(part(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

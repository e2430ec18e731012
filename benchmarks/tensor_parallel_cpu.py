"""Tensor parallelism on the CPU: N gloo ranks against one process, in the same run.

Loads ``--model`` (a GGUF or Hugging Face directory; default the demo checkpoint) once
as a :class:`TorchExecutor` and once per ``--sizes`` value as a
:class:`TensorParallelExecutor`, then times on each, alternating between them
round by round: one ``--prefill`` token prompt, and decode steps at each
``--batches`` size (one row per sequence). Prints one JSON line per figure with
the ratio to one process. On a CPU the ranks share the cores (each gets
``cores / N`` threads) and the memory bandwidth, so this measures what the split
and the per-step messages cost, not a speed-up; the GPU figures come from
benchmarks/gpu_decode.py ``--tensor-parallel-size``.

    OMP_NUM_THREADS=1 python benchmarks/tensor_parallel_cpu.py --sizes 2,4 --batches 1,8

(``OMP_NUM_THREADS=1`` on a loaded machine: the one process's idle intra-op threads
otherwise spin against the load and its figures, not the ranks', measure that.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "cuda")]

from musegl_core.checkpoint.loader import load_checkpoint  # noqa: E402
from musegl_core.engine.executor import SeqChunk, Step  # noqa: E402
from musegl_cuda.executor import TorchExecutor  # noqa: E402
from musegl_cuda.parallel.executor import TensorParallelExecutor  # noqa: E402
from musegl_cuda.parallel.rank import RankSpec  # noqa: E402

BLOCK = 16


def prefill_s(ex, n: int, seq: int) -> float:
    blocks = list(range(-(-n // BLOCK)))
    start = time.perf_counter()
    ex.step(Step([SeqChunk(seq, [5 + i % 200 for i in range(n)], list(range(n)), blocks, sample=1)]))
    return time.perf_counter() - start


def decode_ms(ex, batch: int, steps: int, context: int) -> float:
    per = -(-(context + steps + 1) // BLOCK)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    times = []
    for s in range(steps):
        chunks = [SeqChunk(i, [7], [context + s], tables[i], sample=1) for i in range(batch)]
        start = time.perf_counter()
        ex.step(Step(chunks))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model, float32)")
    p.add_argument("--sizes", default="2,4")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.model is None:
        from musegl_core.tiny import default_model_path

        args.model = str(default_model_path(file_type="f32"))
    sizes = [int(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    blocks = max(max(batches) * -(-(args.context + args.steps + 1) // BLOCK), -(-args.prefill // BLOCK)) + 4
    executors = {1: TorchExecutor(load_checkpoint(args.model), device="cpu", block_size=BLOCK)}
    for n in sizes:
        started = time.perf_counter()
        executors[n] = TensorParallelExecutor(RankSpec(args.model, "cpu", n))
        print(json.dumps({"figure": "startup", "ranks": n, "s": round(time.perf_counter() - started, 1)}))
    for ex in executors.values():
        ex.allocate_kv(blocks)
    figures: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):  # alternate, so load on the shared machine hits every size alike
        for n, ex in executors.items():
            figures.setdefault(("prefill_s", n, args.prefill), []).append(prefill_s(ex, args.prefill, 0))
            for b in batches:
                figures.setdefault(("decode_ms", n, b), []).append(decode_ms(ex, b, args.steps, args.context))
    for (name, n, b), values in sorted(figures.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        value = statistics.median(values)
        base = statistics.median(figures[(name, 1, b)])
        key = "tokens" if name == "prefill_s" else "batch"
        print(json.dumps({"figure": name, "ranks": n, key: b, "value": round(value, 4),
                          "vs_one": round(value / base, 3)}))
    for ex in executors.values():
        ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU time of the torch-cpu executor's steps on one thread: a measure that a shared machine disturbs little.

Loads ``--model`` (default: the cached ``bench`` preset, f16) in the torch-cpu executor with
torch and the stored-weight kernels on one thread, prefills ``--sequences`` prompts of
``--prompt-tokens`` random tokens (one step each), then runs decode steps of 1 and of
``--sequences`` rows. Prints one JSON object: the kernel path, and the thread CPU time
(``time.thread_time``) of the fastest prefill step and the median decode step of each width.
On one thread every step runs on the calling thread, so its CPU time is the work it did,
whatever else the machine runs (cache and memory contention still count). Wall-clock
throughput on several threads is ``llamacpp_compare.py``'s business.

    MUSEGL_CPU_KERNELS=avx2 python benchmarks/cpu_step_cputime.py [--model M.gguf]

To compare with another version of musegl, run the same command in its checkout; to compare
only another version of the stored-weight kernels, ``--kernels-source FILE`` builds them from
that ``weight_kernels.c`` (e.g. ``git show REV:plugins/cuda/musegl_cuda/cpu/weight_kernels.c``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF (default: the bench preset, f16)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=12)
    p.add_argument("--kernels-source", type=Path, default=None,
                   help="build the stored-weight kernels from this weight_kernels.c (default: this checkout's)")
    args = p.parse_args()
    torch.set_num_threads(1)  # before the executor: the kernels' pool takes torch's count
    if args.kernels_source:
        from musegl_cuda.cpu import native as kernel_build

        kernel_build.SOURCE = args.kernels_source.resolve()
    from common import bench_checkpoint
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.cpu import native
    from musegl_cuda.executor import TorchExecutor

    model = args.model or bench_checkpoint()
    blocks = -(-(args.prompt_tokens + args.decode_steps) // 16)
    ex = TorchExecutor(load_checkpoint(model), device="cpu", block_size=16)
    ex.allocate_kv(blocks * args.sequences)
    tables = [list(range(s * blocks, (s + 1) * blocks)) for s in range(args.sequences)]
    generator = torch.Generator().manual_seed(0)

    def chunk(seq: int, tokens: list[int], start: int) -> SeqChunk:
        return SeqChunk(seq=seq, tokens=tokens, positions=list(range(start, start + len(tokens))),
                        blocks=tables[seq], sample=True)

    def cpu_time(step: Step) -> float:
        start = time.thread_time()
        ex.step(step)
        return time.thread_time() - start

    vocab = ex.config.vocab_size
    prefill = [cpu_time(Step([chunk(s, torch.randint(0, vocab, (args.prompt_tokens,), generator=generator).tolist(),
                                    0)])) for s in range(args.sequences)]
    out = {"model": str(model), "kernel_path": native.selected_path(), "prompt_tokens": args.prompt_tokens,
           "prefill_step_s": round(min(prefill), 3)}
    for width in sorted({1, args.sequences}):
        times = [cpu_time(Step([chunk(s, [5 + i], args.prompt_tokens + i) for s in range(width)]))
                 for i in range(args.decode_steps)]
        out[f"decode_{width}_rows_ms"] = round(statistics.median(times[2:]) * 1e3, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

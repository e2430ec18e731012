"""Decode speed, musegl's torch-cpu executor against llama.cpp's llama-bench, interleaved.

A stand-in for llamacpp_compare.py where llama-server was not built in time (README.md):
per round, ``llama-bench -m FILE -t T -p 0 -n N -r R -o json`` (its decode tokens/s
from an empty context), then musegl's decode steps on the same file with T threads
(TorchExecutor, one sequence, a 64-token prompt, then N steps; wall time of each step,
the median over the steps after two). Prints JSON lines, one per side per round.

    python decode_vs_llama_bench.py --llama-bench PATH --model FILE --cpu-kernels avx2 \
        [--llama-env LD_LIBRARY_PATH=DIR] [--rounds 3] [--threads 2] [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def musegl_decode_ms(model: Path, threads: int, steps: int) -> float:
    import torch

    torch.set_num_threads(threads)
    from musegl_core.checkpoint.loader import load_checkpoint
    from musegl_core.engine.executor import SeqChunk, Step
    from musegl_cuda.executor import TorchExecutor

    blocks = -(-(64 + steps) // 16)
    ex = TorchExecutor(load_checkpoint(model), device="cpu", block_size=16)
    ex.allocate_kv(blocks)
    table = list(range(blocks))

    def chunk(tokens: list[int], start: int) -> SeqChunk:
        return SeqChunk(seq=0, tokens=tokens, positions=list(range(start, start + len(tokens))), blocks=table,
                        sample=True)

    ex.step(Step([chunk(list(range(5, 69)), 0)]))
    times = []
    for i in range(steps):
        start = time.perf_counter()
        ex.step(Step([chunk([5 + i], 64 + i)]))
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--llama-bench", required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--cpu-kernels", required=True)
    p.add_argument("--llama-env", action="append", default=[])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--musegl-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.musegl_only:  # the musegl side, in a fresh process with its kernel path pinned
        print(musegl_decode_ms(args.model, args.threads, args.tokens))
        return 0
    llama_env = {**os.environ, **dict(e.split("=", 1) for e in args.llama_env)}
    musegl_env = {**os.environ, "MUSEGL_CPU_KERNELS": args.cpu_kernels}
    for r in range(args.rounds):
        out = subprocess.run([args.llama_bench, "-m", str(args.model), "-t", str(args.threads), "-p", "0", "-n",
                              str(args.tokens), "-r", "3", "-o", "json"], env=llama_env, capture_output=True,
                             text=True, check=True)
        tg = json.loads(out.stdout)[0]
        print(json.dumps({"round": r, "side": "llama.cpp", "model": str(args.model), "tok_s": tg["avg_ts"],
                          "ms_per_token": 1e3 / tg["avg_ts"], "cpu_info": tg.get("cpu_info"),
                          "load_avg": os.getloadavg()}), flush=True)
        ms = float(subprocess.run([sys.executable, __file__, "--musegl-only", "--llama-bench", "-", "--model",
                                   str(args.model), "--cpu-kernels", args.cpu_kernels, "--threads",
                                   str(args.threads), "--tokens", str(args.tokens)], env=musegl_env,
                                  capture_output=True, text=True, check=True).stdout.split()[-1])
        print(json.dumps({"round": r, "side": "musegl", "kernels": args.cpu_kernels, "model": str(args.model),
                          "ms_per_token": ms, "tok_s": 1e3 / ms, "load_avg": os.getloadavg()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

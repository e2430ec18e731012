"""The ITL a client sees against the executor's decode step, at concurrency 1: ``musegl serve
--model`` with ``benchmarks/llamacpp_compare.py``'s flags (``--slots`` wide), one warm-up
``musegl bench`` (chat workload, greedy, ``ignore_eos``), then ``--requests`` measured
requests of ``--prompt-tokens`` / ``--max-tokens``. Prints one JSON line: the bench's ITL
p50/mean, and from ``/metrics`` the decode steps' count and mean time over the measured run
(``musegl_engine_decode_step_seconds`` / ``_decode_steps``): ITL minus that mean is what
the server adds per token around the step (scheduler, worker IPC, detokenization, SSE).

Runs the ``musegl`` importable here (``PYTHONPATH=BASE:BASE/plugins/cuda`` for a base tree).

    python server_itl.py --model FILE [--requests 4] [--prompt-tokens 256] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common
from common import serve  # noqa: E402

from musegl_core.bench import BenchConfig, run_bench  # noqa: E402


def counters(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("musegl_engine_"):
            values[name.removeprefix("musegl_engine_").removesuffix("_total")] = float(value)
    return values


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    width = str(args.slots)
    per_slot = args.prompt_tokens + args.max_tokens + 256
    flags = ("--max-decode-sequences", width, "--max-inflight-requests", width, "--max-sessions", width,
             "--max-context", str(max(2048, per_slot)))
    with serve(args.model, *flags) as url:
        config = BenchConfig(url=url, workload="chat", concurrency=1, requests=2, max_tokens=args.max_tokens,
                             prompt_tokens=args.prompt_tokens, seed=1)
        run_bench(config, progress=False)  # warm-up
        before = counters(url)
        report = run_bench(BenchConfig(url=url, workload="chat", concurrency=1, requests=args.requests,
                                       max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens, seed=0),
                           progress=False)
        after = counters(url)
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    seconds = after.get("decode_step_seconds", 0) - before.get("decode_step_seconds", 0)
    import musegl_cuda
    itl_p50 = report.itl.p50 * 1e3
    step = seconds / steps * 1e3 if steps else None
    print(json.dumps({"tree": str(Path(musegl_cuda.__file__).parents[2]), "model": args.model.name,
                      "output_tok_s": round(report.output_tokens_per_s, 2), "itl_p50_ms": round(itl_p50, 2),
                      "itl_mean_ms": round(report.itl.mean * 1e3, 2) if report.itl.mean else None,
                      "decode_steps": int(steps), "decode_step_mean_ms": round(step, 2) if step else None,
                      "itl_p50_minus_step_ms": round(itl_p50 - step, 2) if step else None,
                      "errors": report.errors, "load_avg": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batched serving vs one request at a time, on one server in one run.

Starts ``musegl serve`` on the bench checkpoint with a decode width of 8 and
runs the ``chat`` workload of ``musegl bench`` twice against it: at
concurrency 1 (each request alone in the engine) and at concurrency 8 (the
scheduler batches up to 8 decodes per step). Prints both reports and the
ratio of aggregate output tokens per second. Target: >= 4x.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from common import bench_checkpoint, serve
from musegl_core.bench import BenchConfig, run_bench
from musegl_core.bench.report import render


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--batched", type=int, default=8, help="concurrency (and decode width) of the batched run")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args()
    console = Console()
    model = bench_checkpoint()
    width = str(args.batched)
    flags = ("--max-decode-sequences", width, "--max-inflight-requests", width, "--max-sessions", width,
             "--max-context", "2048")
    reports = {}
    with serve(model, *flags) as url:
        for concurrency in (1, args.batched):
            config = BenchConfig(url=url, workload="chat", concurrency=concurrency,
                                 requests=args.requests_per_client * concurrency, max_tokens=args.max_tokens,
                                 prompt_tokens=args.prompt_tokens)
            reports[concurrency] = report = run_bench(config)
            render(report, console)
    single, batched = reports[1], reports[args.batched]
    ratio = batched.output_tokens_per_s / single.output_tokens_per_s if single.output_tokens_per_s else float("nan")
    figures = {
        "concurrency_1_output_tok_s": single.output_tokens_per_s,
        f"concurrency_{args.batched}_output_tok_s": batched.output_tokens_per_s,
        "ratio": ratio,
        "target": 4.0,
        "errors": single.errors + batched.errors,
        "itl_p50_s": {"1": single.itl.p50, str(args.batched): batched.itl.p50},
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    console.print(f"output tok/s: concurrency 1 = {single.output_tokens_per_s:.2f}, "
                  f"concurrency {args.batched} = {batched.output_tokens_per_s:.2f}, "
                  f"ratio = {ratio:.2f}x (target >= 4x)")
    return 0 if not figures["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

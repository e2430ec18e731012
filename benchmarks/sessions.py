"""Session prefix reuse: TTFT of a late agent turn with its session vs anonymous.

Starts ``musegl serve`` on the bench checkpoint (no prefix snapshots and no
automatic prefix caching, so an anonymous request always prefills its whole
history) and runs the ``agent``
workload of ``musegl bench``: a few conversations of several turns in named
sessions, each turn adding the reply and a new user message of a few hundred
tokens. Afterwards the bench resends each conversation's last-turn history
without ``session_id``. Prints the TTFT of the last turn with the session, the
TTFT of the same history anonymous, and their ratio. Target: <= 1/5.
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
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--turn-tokens", type=int, default=300, help="approximate tokens of each new user message")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args()
    console = Console()
    model = bench_checkpoint()
    slots = str(max(args.conversations * 2, args.concurrency))  # named sessions + anonymous replays
    flags = ("--max-sessions", slots, "--max-inflight-requests", str(args.concurrency),
             "--max-decode-sequences", str(args.concurrency), "--max-context", "8192",
             "--prefix-cache-entries", "0", "--no-prefix-caching")
    with serve(model, *flags) as url:
        config = BenchConfig(url=url, workload="agent", concurrency=args.concurrency,
                             conversations=args.conversations, turns=args.turns, max_tokens=args.max_tokens,
                             prompt_tokens=args.turn_tokens)
        report = run_bench(config)
    render(report, console)
    s = report.sessions
    if s is None or s.ratio is None:
        console.print("[red]no comparison: some requests failed[/red]")
        return 1
    figures = {
        "turn": s.turn,
        "session_ttft_s": s.session_ttft.mean,
        "anonymous_ttft_s": s.anonymous_ttft.mean,
        "ratio": s.ratio,
        "target": 0.2,
        "cached_ratio": report.cached_ratio,
        "errors": report.errors,
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    console.print(f"turn {s.turn} TTFT: session {s.session_ttft.mean * 1000:.0f} ms, "
                  f"anonymous {s.anonymous_ttft.mean * 1000:.0f} ms, ratio {s.ratio:.3f} "
                  f"(1/{1 / s.ratio:.1f}; target <= 1/5)")
    return 0 if not report.errors else 1


if __name__ == "__main__":
    raise SystemExit(main())

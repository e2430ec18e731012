"""Replicas behind vllm-router: what session affinity buys (docs/scaling.md, "Replicas").

For each router policy asked for, starts two fresh ``musegl serve`` replicas
(so that no policy reads another's prompts from the prefix cache: the bench's
text is the same every run) and a ``vllm-router`` in front of them, then runs
``musegl bench --workload agent`` through the router: conversations in named sessions, every turn resending the
whole history with its session in ``X-Session-Id``. Prints, per policy, the
mean TTFT of turn 1 and of the later turns, the share of the later turns'
prompt tokens read from cache, and the later turns' TTFT as a ratio of
``round_robin``'s (the baseline of the same run: no affinity, each turn
prefilled again wherever it lands) when that policy was run too.

On the CPU it runs at a small shape; on a GPU host give each replica its
device (``--devices cuda:0 cuda:1``) and a real checkpoint (``--model``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from common import bench_checkpoint, free_port, serve, server_process
from musegl_core.bench import BenchConfig, run_bench


def router(workers: list[str], policy: str):
    port = free_port()
    command = [sys.executable, "-c", "from vllm_router.launch_router import main; main()",
               "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy,
               "--prometheus-port", str(free_port()), "--health-check-interval-secs", "5"]
    return server_process(command, port, name=f"vllm-router-{policy}", ready_timeout=120)


def figures(report) -> dict:
    later = [t for t in report.turns if t.turn >= 2]
    prompt = sum(t.prompt_tokens for t in later)
    weight = sum(t.requests for t in later)
    return {
        "errors": report.errors,
        "turn1_ttft_s": report.turns[0].ttft.mean if report.turns else None,
        "later_ttft_s": sum(t.ttft.mean * t.requests for t in later) / weight if weight else None,
        "later_cached_share": sum(t.cached_tokens for t in later) / prompt if prompt else None,
        "sessions_deleted": report.sessions_deleted,
        "sessions_left": len(report.sessions_left),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint of both replicas (default: the bench preset)")
    p.add_argument("--devices", nargs=2, metavar="DEVICE", help="each replica's --device (default: the executor's)")
    p.add_argument("--policies", nargs="+", default=["sticky_least_loaded", "consistent_hash", "round_robin"])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=200, help="approximate tokens of each new user message")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-context", type=int, default=8192)
    args = p.parse_args()
    model = args.model or str(bench_checkpoint())
    flags = ["--max-sessions", str(args.conversations), "--max-context", str(args.max_context)]
    results: dict[str, dict] = {}
    for policy in args.policies:
        with contextlib.ExitStack() as stack:
            replicas = [stack.enter_context(serve(model, *flags, *(("--device", d) if d else ())))
                        for d in (args.devices or (None, None))]
            with router(replicas, policy) as (url, _process):
                config = BenchConfig(url=url, workload="agent", concurrency=args.concurrency,
                                     conversations=args.conversations, turns=args.turns,
                                     max_tokens=args.max_tokens, prompt_tokens=args.turn_tokens, baseline=False)
                results[policy] = figures(run_bench(config, progress=False))
    base = results.get("round_robin", {}).get("later_ttft_s")
    for entry in results.values():
        later = entry["later_ttft_s"]
        entry["later_ttft_vs_round_robin"] = later / base if base and later is not None else None
    print(json.dumps(results, indent=2))
    return 0 if all(entry["errors"] == 0 for entry in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Decode speed with and without a JSON-Schema constraint, on one server in one run.

Starts ``musegl serve`` on the bench checkpoint (decode width 8) and sends the
same chat requests with and without ``response_format`` json_schema, at
concurrency 1 and 8, each generating exactly ``--max-tokens`` tokens
(``ignore_eos``; the schema is an open array of strings, which the
random-weight model never closes, so every token is generated under the
grammar). Reports aggregate completion tokens per second for each case and
the constrained/free ratio: the cost of the masks. With ``--grammar-threads``
values (default ``0,2``) it runs one server per value in the same run: 0
computes the masks on the engine thread between steps, N > 0 on N threads
while the forward pass runs (``musegl_core/engine/masks.py``). For the
constrained runs it also reports, from ``/metrics``, the share of the wall
time spent computing masks and the share the engine thread was blocked on
them (computing inline, or waiting for a mask not ready): the part of the
mask cost on the critical path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from common import bench_checkpoint, serve

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
          "required": ["items"]}


async def run(url: str, concurrency: int, requests: int, max_tokens: int, constrained: bool) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "List things. " * 8}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.8}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}
    queue = list(range(requests))
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            response = await http.post(f"{url}/v1/chat/completions", json={**body, "seed": i}, timeout=600)
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return tokens / (time.perf_counter() - started)


def mask_seconds(url: str) -> tuple[float, float]:
    """(computing, engine thread blocked) grammar-mask seconds from /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("musegl_grammar_mask_seconds_total", "musegl_grammar_mask_blocked_seconds_total"):
            values[name] = float(value)
    return (values.get("musegl_grammar_mask_seconds_total", 0.0),
            values.get("musegl_grammar_mask_blocked_seconds_total", 0.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--batched", type=int, default=8)
    p.add_argument("--grammar-threads", default="0,2",
                   help="comma-separated --grammar-threads values, one server each (0: masks on the engine "
                        "thread between steps; N: N threads overlapping the forward); default %(default)s")
    args = p.parse_args()
    width = str(args.batched)
    figures = {}
    for threads in [int(t) for t in args.grammar_threads.split(",")]:
        flags = ("--max-decode-sequences", width, "--max-inflight-requests", width, "--max-sessions", width,
                 "--max-context", "2048", "--constrained-reasoning-tokens", "0", "--grammar-threads", str(threads))
        with serve(bench_checkpoint(), *flags) as url:
            asyncio.run(run(url, 1, 1, 8, True))  # warm-up: the worker builds the llguidance vocabulary once
            for concurrency in (1, args.batched):
                for constrained in (False, True):
                    before, started = mask_seconds(url), time.perf_counter()
                    rate = asyncio.run(run(url, concurrency, args.requests_per_client * concurrency,
                                           args.max_tokens, constrained))
                    wall, after = time.perf_counter() - started, mask_seconds(url)
                    kind = "json_schema" if constrained else "free"
                    figures[f"threads{threads}_c{concurrency}_{kind}_tok_s"] = round(rate, 2)
                    line = f"{rate:8.2f} completion tok/s"
                    if constrained:  # the masks' share of the wall time: computed, and blocking the engine
                        computed = (after[0] - before[0]) / wall
                        blocked = (after[1] - before[1]) / wall
                        figures[f"threads{threads}_c{concurrency}_mask_compute_share"] = round(computed, 4)
                        figures[f"threads{threads}_c{concurrency}_mask_blocked_share"] = round(blocked, 4)
                        line += f", masks {computed:.2%} of the time, engine blocked on them {blocked:.2%}"
                    print(f"grammar threads {threads} concurrency {concurrency:2d} {kind:11s} {line}", flush=True)
        for concurrency in (1, args.batched):
            free = figures[f"threads{threads}_c{concurrency}_free_tok_s"]
            bound = figures[f"threads{threads}_c{concurrency}_json_schema_tok_s"]
            figures[f"threads{threads}_c{concurrency}_ratio"] = round(bound / free, 3) if free else None
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

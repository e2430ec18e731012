"""Where requests' time to first token goes, from a worker timeline (``musegl serve --trace-steps FILE``).

    python benchmarks/trace_report.py FILE [--bursts]      # FILE may be gzipped (.gz)

Prints, over every request with all its stages, the percentiles (p50/p90/max, milliseconds) of
received -> prepared (the preparation lanes), prepared -> admitted (the engine's inbox and admission),
admitted -> first_token (prefill, queued behind other prompts) and received -> first_token; then the
steps by kind (count, mean rows, mean milliseconds) and the garbage collections of at least 1 ms
(count, total and longest, per generation). With ``--bursts``, each burst of requests
(received within 50 ms of the previous one) as one line: size, when the last arrived, was prepared
and admitted, and when the first, median and last first token came (milliseconds from the burst's
first arrival), with the prefill rows and steps between.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--bursts", action="store_true", help="one line per burst of arriving requests")
    p.add_argument("--gap", type=float, default=0.05, help="seconds between arrivals that start a new burst")
    args = p.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt", encoding="utf-8") as stream:
        lines = [json.loads(line) for line in stream if line.strip()]
    stages: dict[str, dict[str, float]] = collections.defaultdict(dict)
    steps = []
    collections_by_generation = collections.defaultdict(list)
    for line in lines:
        if line["event"] == "step":
            steps.append(line)
        elif line["event"] == "gc":
            collections_by_generation[line["generation"]].append(line["seconds"])
        elif "id" in line:
            stages[line["id"]].setdefault(line["event"], line["t"])
    full = {rid: s for rid, s in stages.items() if {"received", "prepared", "admitted", "first_token"} <= s.keys()}
    print(f"{len(full)} requests with every stage, {len(steps)} steps")
    for name, a, b in (("prepare", "received", "prepared"), ("to engine", "prepared", "admitted"),
                       ("prefill wait", "admitted", "first_token"), ("worker ttft", "received", "first_token")):
        gaps = [1000 * (s[b] - s[a]) for s in full.values()]
        if gaps:
            print(f"  {name:13s} p50 {pct(gaps, 0.5):8.1f}  p90 {pct(gaps, 0.9):8.1f}  max {max(gaps):8.1f} ms")
    kinds = collections.defaultdict(list)
    for step in steps:
        kinds[step["kind"]].append(step)
    for kind, group in sorted(kinds.items()):
        print(f"  {kind:8s} steps {len(group):5d}  mean rows {statistics.mean(s['decode'] + s['prefill'] for s in group):7.1f}"
              f"  mean {1000 * statistics.mean(s['seconds'] for s in group):7.1f} ms")
    for generation, pauses in sorted(collections_by_generation.items()):
        print(f"  gc gen {generation}  {len(pauses):5d} pauses >= 1 ms  total {1000 * sum(pauses):8.1f}"
              f"  max {1000 * max(pauses):7.1f} ms")
    if not args.bursts:
        return
    order = sorted(full.items(), key=lambda item: item[1]["received"])
    bursts: list[list[dict[str, float]]] = []
    for _, s in order:
        if bursts and s["received"] - bursts[-1][-1]["received"] <= args.gap:
            bursts[-1].append(s)
        else:
            bursts.append([s])
    print("burst  size  last recv  last prep  last admit  first tok  median tok  last tok  prefill rows  steps")
    for number, burst in enumerate(bursts, 1):
        t0 = burst[0]["received"]
        firsts = sorted(s["first_token"] for s in burst)
        end = firsts[-1]
        between = [st for st in steps if t0 <= st["t"] <= end + 1e-6]
        ms = lambda t: 1000 * (t - t0)  # noqa: E731
        print(f"{number:5d} {len(burst):5d} {ms(max(s['received'] for s in burst)):10.1f} "
              f"{ms(max(s['prepared'] for s in burst)):10.1f} {ms(max(s['admitted'] for s in burst)):11.1f} "
              f"{ms(firsts[0]):10.1f} {ms(statistics.median(firsts)):11.1f} {ms(end):9.1f} "
              f"{sum(st['prefill'] for st in between):13d} {len(between):6d}")


if __name__ == "__main__":
    main()

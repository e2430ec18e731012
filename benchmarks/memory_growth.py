"""What grows in the server's memory under the soak's mix, by allocation site and by object type.

Starts ``musegl serve`` as :mod:`soak` does, with :mod:`memtrace` enabled (a snapshot on
``SIGUSR2``) and, with ``--frames``, ``PYTHONTRACEMALLOC`` set, so the front and the worker both
trace their Python allocations. It runs the soak's warm-up, then ``--rounds``
rounds of ``--round`` seconds of load; after the warm-up and after each round, once the server is
idle, both processes dump a snapshot and their RSS is read. The report compares the last snapshot
with the first (after the warm-up): the allocation sites that grew most, the object types whose
count grew, and the large containers (500 entries or more) that grew, per process.

Tracing slows the server a great deal: the figures are for finding what grows, not for timing.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

import psutil

import memtrace
import soak as soak_mod
from common import serve_process


def report(name: str, first: dict, last: dict, top: int) -> None:
    print(f"\n===== {name} =====")
    if first["snapshot"] is not None:
        print("-- allocation sites, growth (tracemalloc) --")
        for stat in last["snapshot"].compare_to(first["snapshot"], "traceback")[:top]:
            print(f"{stat.size_diff / 2**10:+10.1f} KiB {stat.count_diff:+8d} blocks  (now {stat.size / 2**10:.1f} KiB)")
            for line in stat.traceback.format()[-8:]:
                print("      " + line)
        total = sum(s.size for s in last["snapshot"].statistics("filename")) - sum(
            s.size for s in first["snapshot"].statistics("filename"))
        print(f"-- traced total growth {total / 2**20:+.2f} MiB")
    mib = {k: round(v / 2**20, 1) for k, v in first.get("malloc", {}).items()}
    print(f"-- malloc MiB: first {mib}, last {({k: round(v / 2**20, 1) for k, v in last.get('malloc', {}).items()})}")
    print("-- object counts, growth --")
    diff = last["counts"].copy()
    diff.subtract(first["counts"])
    for kind, n in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
        if n > 0:
            print(f"{n:+8d}  {kind}  (now {last['counts'][kind]})")
    print("-- large containers, growth --")
    for key, n in sorted(last["sizes"].items(), key=lambda kv: -(kv[1] - first["sizes"].get(kv[0], 0)))[:top]:
        print(f"{n - first['sizes'].get(key, 0):+8d}  (now {n})  {key}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=float, default=20)
    p.add_argument("--round", type=float, default=60, help="seconds of load per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--frames", type=int, default=6, help="tracemalloc frames per allocation (0: no tracing)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--trim", action="store_true",
                   help="after each snapshot, malloc_trim(0) in the server processes and read their RSS again")
    p.add_argument("--no-hostile", action="store_true", help="leave the hostile and oversize bodies out")
    args = p.parse_args()
    from musegl_core.tiny import default_model_path, demo_mmproj_path

    model = str(default_model_path(progress=True))
    projector = demo_mmproj_path(model)
    flags = (*soak_mod.SERVE_FLAGS, *(("--mmproj", projector) if projector else ()),
             "--max-sessions", str(4 * args.clients), "--max-inflight-requests", str(3 * args.clients))
    if args.no_hostile:
        soak_mod.ACTIONS.pop("hostile"), soak_mod.ACTIONS.pop("oversize")
    folder = Path(tempfile.mkdtemp(prefix="musegl-memtrace-"))
    memtrace.enable(folder, frames=args.frames, trim=args.trim)
    with serve_process(model, *flags) as (url, process):
        front = psutil.Process(process.pid)
        (worker,) = front.children()
        procs = {"front": front, "worker": worker}
        asyncio.run(soak_mod.settle(url))
        load = soak_mod.Soak(url, args.clients, random.Random(args.seed),
                             hostile=[] if args.no_hostile else soak_mod.hostile_bodies())
        asyncio.run(load.run(args.warmup, prime=not args.no_hostile))
        asyncio.run(soak_mod.quiet(url))
        dumps = [memtrace.dump(procs, folder)]
        rss = [{n: soak_mod.rss_mib(p) for n, p in procs.items()}]
        print(f"warm: rss {rss[-1]}, malloc in use MiB "
              f"{ {n: round(dumps[0][n].get('malloc', {}).get('in_use', 0) / 2**20, 1) for n in procs} }", flush=True)
        for i in range(args.rounds):
            asyncio.run(load.run(args.round))
            asyncio.run(soak_mod.quiet(url))
            dumps.append(memtrace.dump(procs, folder))
            rss.append({n: soak_mod.rss_mib(p) for n, p in procs.items()})
            malloc = {n: round(d[n].get("malloc", {}).get("in_use", 0) / 2**20, 1) for d in dumps[-1:] for n in procs}
            print(f"round {i + 1}: rss {rss[-1]}, requests {sum(load.tally.outcomes.values())}, "
                  f"malloc in use MiB {malloc}, errors {dict(load.tally.errors)}", flush=True)
    for name in procs:
        report(name, dumps[0][name], dumps[-1][name], args.top)
        if len(dumps) > 2:
            print(f"-- {name}: last round only --")
            report(name + " (last round)", dumps[-2][name], dumps[-1][name], 10)
    print(f"\nsnapshots in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long small torch ops take beside a busy Python thread, at a few GIL switch intervals.

    python benchmarks/gil_convoy.py [--ops 300] [--busy 1] [--intervals 0.005,0.001,0.0001]

Every torch op gives up the GIL and takes it back; while another thread runs Python, each retake
waits until that thread is made to yield, up to the switch interval. The engine thread's
prefill steps are several hundred such calls, the preparation threads the busy Python
(docs/engine.md, "Sharing the GIL with the engine thread"). One JSON line per interval: the
median of 7 runs of ``--ops`` ``torch.add`` calls alone and beside ``--busy`` spinning threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch


def ops_seconds(ops: int, x: torch.Tensor) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        torch.add(x, x)
    return time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=300)
    p.add_argument("--busy", type=int, default=1, help="threads that run Python meanwhile")
    p.add_argument("--intervals", default="0.005,0.001,0.0001", help="switch intervals, seconds")
    args = p.parse_args()
    x = torch.ones(8)
    for interval in map(float, args.intervals.split(",")):
        sys.setswitchinterval(interval)
        alone = statistics.median(ops_seconds(args.ops, x) for _ in range(7))
        stop = threading.Event()

        def spin() -> None:
            total = 0
            while not stop.is_set():
                for i in range(1000):
                    total += i * i

        threads = [threading.Thread(target=spin, daemon=True) for _ in range(args.busy)]
        for thread in threads:
            thread.start()
        time.sleep(0.05)
        busy = statistics.median(ops_seconds(args.ops, x) for _ in range(7))
        stop.set()
        for thread in threads:
            thread.join()
        print(json.dumps({"switch_interval_ms": interval * 1000, "ops": args.ops, "busy_threads": args.busy,
                          "alone_ms": round(alone * 1000, 2), "beside_busy_ms": round(busy * 1000, 2)}))


if __name__ == "__main__":
    main()

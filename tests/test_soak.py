"""The 2-minute soak (benchmarks/soak.py): mixed load, then no unexpected error,
no leaked KV block, flat memory in use (malloc's bytes in use and pymalloc's blocks,
read inside each process: benchmarks/memtrace.py) and a bounded RSS. Marked slow.

The RSS is read at idle, after the front has given freed memory back
(musegl_core/http/memory.py): before that the front's RSS was mostly free
space glibc kept from the 10 MiB bodies, and its growth (+3.6 % to +13.9 %,
with Python objects and malloc's bytes in use flat) was noise, not a leak.
soak.py's docstring has the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


@pytest.mark.slow
def test_two_minute_soak_leaks_nothing():
    done = subprocess.run([sys.executable, str(SOAK), "--duration", "120", "--warmup", "20", "--json"],
                          capture_output=True, text=True, timeout=900, cwd=SOAK.parent)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({k: report[k] for k in ("requests", "outcomes", "errors", "error_examples", "rss_mib", "in_use_mib",
                                             "kv_end", "kv_leaked")}))
    assert report["errors"] == {}, report["error_examples"]
    assert report["kv_leaked"] == {"kv_blocks_used": 0.0, "kv_blocks_reserved": 0.0}
    assert not report["worker_restarted"]
    # The worker's RSS stays flat (net of the host KV tier filling its pages, soak.py). The front's
    # climbs in steps while the hostile mix's bodies (30 MB enums, 100k messages, 6 MiB prompts) are
    # parsed on the preparation threads, to a high-water mark it then keeps: in the 600 s run
    # (benchmarks/results/soak_hardening_2026-12-07_600s.json) 279 MiB at 67 s, 294 at 100-233 s, 311-330 from 310 s to 604 s. Two minutes after a 20 s warm-up end
    # inside that climb (+8.9 % to +18.5 % measured beside the slow tier), so the front is held to
    # 30 %: a per-request leak over these ~2,400 requests still exceeds it.
    tolerance = {"front": 0.30, "worker": 0.10}
    for process in ("front", "worker"):
        assert abs(report["rss_mib"][process]["growth"]) <= tolerance[process], report["rss_mib"]
        # what the process uses, without the free space malloc keeps: flat (issue 47)
        assert abs(report["in_use_mib"][process]["growth"]) <= 0.10, report["in_use_mib"]
    kinds = {key.split()[0] for key in report["outcomes"]}
    assert kinds >= {"stream", "cancel", "plain", "session", "bad", "oversize", "delete"}
    # /health and the probe answered throughout and the log stayed bounded; their latency (soak.py's
    # --health-p99 / --probe-p99, hence its exit status) is the benchmark's to judge on a quiet machine
    # (benchmarks/README.md), not this test's beside the rest of the slow tier
    assert report["health_s"]["n"] > 0 and report["probe_s"]["n"] > 0, report
    assert report["log_growth_mb"] <= 50

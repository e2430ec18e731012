"""``musegl bench``: a load generator for a running musegl server.

The package is split by concern:

* :mod:`~musegl_core.bench.workloads`: deterministic filler text and the two
  workloads, ``chat`` (independent prompts) and ``agent`` (multi-turn
  histories in named sessions that grow every turn);
* :mod:`~musegl_core.bench.client`: one streamed chat completion, timed
  (time to first token, gaps between deltas, usage);
* :mod:`~musegl_core.bench.report`: percentiles and the aggregate
  :class:`BenchReport`, as a rich table or a JSON-ready dict;
* :mod:`~musegl_core.bench.runner`: :func:`run_bench`, which drives N
  concurrent clients with a progress bar and returns the report;
* ``--api messages|responses``: :mod:`~musegl_core.bench.agent_script` (the
  synthetic coding-agent conversation: long system prompt, ~10 tools),
  :mod:`~musegl_core.bench.cli_wire` (that conversation as Claude Code, Codex
  CLI and Chat Completions send it, and their stream readers) and
  :mod:`~musegl_core.bench.replay` (the CLI's turns interleaved with the Chat
  Completions reference).

``benchmarks/`` uses :func:`run_bench` directly; the CLI wraps it. The
HTTP client (httpx) comes with the ``bench`` extra: ``pip install 'musegl[bench]'``.
"""

from __future__ import annotations

from musegl_core.bench.report import BenchReport, LatencyStats, TurnStats
from musegl_core.bench.runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "BenchReport", "LatencyStats", "TurnStats", "run_bench"]

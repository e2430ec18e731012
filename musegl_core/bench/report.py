"""Aggregate bench results: percentiles, throughput, per-turn session figures.

:func:`build_report` turns the list of :class:`RequestResult` of one run into a
:class:`BenchReport`; :meth:`BenchReport.to_dict` is what ``--json`` prints and
:func:`render` draws the same figures as rich tables.

Throughput counts only the measured phase (``chat`` requests or ``agent``
turns) over its wall time; the anonymous ``baseline`` replays of the agent
workload run afterwards and are reported on their own.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Sequence

import attrs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from musegl_core.bench.client import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@attrs.frozen
class LatencyStats:
    """p50 / p95 / p99 / mean of a latency sample, in seconds (None when empty)."""

    count: int
    p50: float | None
    p95: float | None
    mean: float | None
    p99: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> "LatencyStats":
        sample = list(values)
        mean = sum(sample) / len(sample) if sample else None
        return cls(len(sample), percentile(sample, 50), percentile(sample, 95), mean, percentile(sample, 99))


@attrs.frozen
class TurnStats:
    """The ``agent`` figures of one turn number across conversations."""

    turn: int
    requests: int
    ttft: LatencyStats
    prompt_tokens: int
    cached_tokens: int


@attrs.frozen
class SessionComparison:
    """TTFT of the last agent turn in its session vs the same history anonymous."""

    turn: int
    session_ttft: LatencyStats
    anonymous_ttft: LatencyStats
    anonymous_cached_tokens: int
    #: mean session TTFT / mean anonymous TTFT (lower is better; None if a side is empty)
    ratio: float | None


#: A warm turn is held when at least this share of its prompt came from the cache (issue 45's
#: "next turn cached >= 95 %").
WARM_SHARE = 0.95


@attrs.frozen
class WarmStats:
    """``agent``: the turns after each conversation's first (warm turns: their history was sent
    before), subagents' conversations included. A conversation is held when it had a warm turn
    and every one of them succeeded with at least :data:`WARM_SHARE` of its prompt cached (the
    server kept its context the whole run, on the device or in a tier below)."""

    sessions: int
    sessions_held: int
    warm_turns: int
    warm_turns_held: int
    ttft: LatencyStats

    @classmethod
    def of(cls, results: Sequence[RequestResult]) -> "WarmStats":
        by_conversation: dict[int, list[RequestResult]] = {}
        for r in results:
            if r.kind == "turn":
                by_conversation.setdefault(r.conversation, []).append(r)
        warm = [r for r in results if r.kind == "turn" and r.turn > 1]

        def held(r: RequestResult) -> bool:
            return r.ok and r.prompt_tokens > 0 and r.cached_tokens >= WARM_SHARE * r.prompt_tokens

        sessions_held = sum(1 for turns in by_conversation.values()
                            if any(r.turn > 1 for r in turns) and all(held(r) for r in turns if r.turn > 1))
        return cls(len(by_conversation), sessions_held, len(warm), sum(1 for r in warm if held(r)),
                   LatencyStats.of(r.ttft for r in warm if r.ok and r.ttft is not None))


@attrs.frozen
class SpeculationStats:
    """Speculative decoding over the measured phase, from the server's ``/metrics``
    before and after it (other clients of the same server would count too).

    ``acceptance_length`` is tokens committed per verified block (accepted drafts
    + 1); ``tokens_per_target_step`` is output tokens per executor step (prefill
    steps included)."""

    target_steps: int
    drafted_tokens: int
    accepted_tokens: int
    verify_blocks: int
    acceptance_length: float | None
    tokens_per_target_step: float | None


#: What issue 27 asks of the ``--api`` replays: later-turn TTFT at most this share of turn 1's,
#: at least this share of a later turn's prompt cached, front overhead at most this vs Chat Completions.
TARGETS = {"ttft_ratio": 0.2, "cached_share": 0.9, "front_overhead": 0.05}


@attrs.frozen
class ReplaySide:
    """One API's figures over a ``--api`` replay (TTFT means in seconds)."""

    api: str
    turns: tuple[TurnStats, ...]
    first_turn_ttft: float | None
    #: mean TTFT of turns 2 and later
    later_ttft: float | None
    #: later_ttft / first_turn_ttft
    ttft_ratio: float | None
    #: cached / prompt tokens, summed over turns 2 and later
    later_cached_share: float | None
    #: the lowest per-turn cached share of turns 2 and later
    min_cached_share: float | None
    #: mean request body size of turn 1 (JSON bytes)
    first_request_bytes: int


@attrs.frozen
class ReplaySummary:
    """``--api messages|responses``: the CLI's conversation vs the same one over Chat Completions."""

    api: str
    cli: ReplaySide
    reference: ReplaySide
    #: mean CLI TTFT / mean Chat Completions TTFT - 1 over the turns (2 and later) both completed:
    #: what the new surface adds in front of the worker, as a share of a cached turn's TTFT
    front_overhead: float | None
    #: the same difference in seconds (mean of the paired differences)
    front_overhead_s: float | None
    #: the median of the per-turn ratios CLI TTFT / Chat TTFT - 1 (less sensitive to one slow request)
    front_overhead_median: float | None
    #: the same ratio on turn 1 (full prefill, so the front's share is small)
    first_turn_overhead: float | None
    #: the same ratio of the whole request time (answers differ in length: indicative only)
    latency_ratio: float | None
    targets: dict[str, float]
    meets: dict[str, bool]


@attrs.frozen
class BenchReport:
    """Everything one ``musegl bench`` run measured."""

    url: str
    workload: str
    concurrency: int
    max_tokens: int
    tokens_per_word: float
    #: prompt tokens the server adds around the filler (template, BOS), from calibration
    prompt_overhead: int
    requests: int
    succeeded: int
    errors: int
    error_kinds: dict[str, int]
    #: per error kind, the server's message of its first occurrence (it names the limit that refused)
    error_messages: dict[str, str]
    duration_s: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    cached_ratio: float
    ttft: LatencyStats
    itl: LatencyStats
    latency: LatencyStats
    turns: tuple[TurnStats, ...] = ()
    sessions: SessionComparison | None = None
    speculation: SpeculationStats | None = None
    #: ``agent``: named sessions deleted at the end of the run, and those left (id -> why)
    sessions_deleted: int = 0
    sessions_left: dict[str, str] = attrs.field(factory=dict)
    #: ``chat`` (Chat Completions), ``messages`` or ``responses`` (the CLI replays)
    api: str = "chat"
    replay: ReplaySummary | None = None
    #: devices the server's model spans (``--tensor-parallel-size``), and the output tokens/s per device
    tensor_parallel_size: int = 1
    output_tokens_per_s_per_device: float = 0.0
    #: ``agent`` over Chat Completions: the warm turns and the sessions held
    warm: WarmStats | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``musegl bench --json`` prints)."""
        return attrs.asdict(self)


def _short_error(error: str) -> str:
    return error.split(":", 1)[0][:80]


def _first_messages(failed: Sequence[RequestResult]) -> dict[str, str]:
    messages: dict[str, str] = {}
    for result in failed:
        messages.setdefault(_short_error(result.error or ""), _error_detail(result.error or ""))
    return messages


def _error_detail(error: str) -> str:
    """The text after the kind: the server's message (it names the flag that refused)."""
    return error.split(":", 1)[1].strip()[:300] if ":" in error else ""


def build_report(
    results: Sequence[RequestResult],
    *,
    url: str,
    workload: str,
    concurrency: int,
    max_tokens: int,
    tokens_per_word: float,
    prompt_overhead: int,
    duration_s: float,
    baselines: Sequence[RequestResult] = (),
    counters: tuple[dict[str, float], dict[str, float]] | None = None,
    sessions_deleted: int = 0,
    sessions_left: dict[str, str] | None = None,
    api: str = "chat",
    references: Sequence[RequestResult] = (),
    tensor_parallel_size: int = 1,
) -> BenchReport:
    """Aggregate the measured ``results`` (and the agent ``baselines``) of one run; an ``--api``
    replay's ``results`` are the CLI's turns and ``references`` its Chat Completions turns."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    turns: tuple[TurnStats, ...] = ()
    comparison = None
    if workload == "agent":
        turns = turn_stats(results)
        if baselines:
            last = max(b.turn for b in baselines)
            session = LatencyStats.of(r.ttft for r in ok if r.turn == last and r.ttft is not None)
            anonymous_ok = [b for b in baselines if b.ok and b.ttft is not None]
            anonymous = LatencyStats.of(b.ttft for b in anonymous_ok)
            ratio = session.mean / anonymous.mean if session.mean is not None and anonymous.mean else None
            comparison = SessionComparison(last, session, anonymous, sum(b.cached_tokens for b in anonymous_ok), ratio)
    return BenchReport(
        url=url,
        workload=workload,
        concurrency=concurrency,
        max_tokens=max_tokens,
        tokens_per_word=round(tokens_per_word, 3),
        prompt_overhead=prompt_overhead,
        requests=len(results),
        succeeded=len(ok),
        errors=len(failed),
        error_kinds=dict(Counter(_short_error(r.error or "") for r in failed)),
        error_messages=_first_messages(failed),
        duration_s=duration_s,
        requests_per_s=len(ok) / duration,
        output_tokens=output,
        output_tokens_per_s=output / duration,
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_ratio=cached / prompt if prompt else 0.0,
        ttft=LatencyStats.of(r.ttft for r in ok if r.ttft is not None),
        itl=LatencyStats.of(gap for r in ok for gap in r.itls),
        latency=LatencyStats.of(r.latency for r in ok if r.latency is not None),
        turns=turns,
        sessions=comparison,
        speculation=_speculation(counters, output),
        sessions_deleted=sessions_deleted,
        sessions_left=dict(sessions_left or {}),
        api=api,
        replay=replay_summary(api, results, references) if api != "chat" else None,
        tensor_parallel_size=tensor_parallel_size,
        output_tokens_per_s_per_device=output / duration / tensor_parallel_size,
        warm=WarmStats.of(results) if workload == "agent" and api == "chat" else None,
    )


def turn_stats(results: Sequence[RequestResult]) -> tuple[TurnStats, ...]:
    """Per turn number: requests, TTFT of those that succeeded, their prompt and cached tokens."""
    ok = [r for r in results if r.ok]
    return tuple(
        TurnStats(
            turn=n,
            requests=sum(1 for r in results if r.turn == n),
            ttft=LatencyStats.of(r.ttft for r in ok if r.turn == n and r.ttft is not None),
            prompt_tokens=sum(r.prompt_tokens for r in ok if r.turn == n),
            cached_tokens=sum(r.cached_tokens for r in ok if r.turn == n),
        )
        for n in sorted({r.turn for r in results})
    )


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _side(api: str, results: Sequence[RequestResult]) -> ReplaySide:
    ok = [r for r in results if r.ok]
    first = [r.ttft for r in ok if r.turn == 1 and r.ttft is not None]
    later = [r.ttft for r in ok if r.turn >= 2 and r.ttft is not None]
    first_ttft, later_ttft = _mean(first), _mean(later)
    later_turns = [t for t in turn_stats(results) if t.turn >= 2 and t.prompt_tokens]
    prompt = sum(t.prompt_tokens for t in later_turns)
    sizes = [r.request_bytes for r in results if r.turn == 1 and r.request_bytes]
    return ReplaySide(
        api=api,
        turns=turn_stats(results),
        first_turn_ttft=first_ttft,
        later_ttft=later_ttft,
        ttft_ratio=later_ttft / first_ttft if later_ttft is not None and first_ttft else None,
        later_cached_share=sum(t.cached_tokens for t in later_turns) / prompt if prompt else None,
        min_cached_share=min((t.cached_tokens / t.prompt_tokens for t in later_turns), default=None),
        first_request_bytes=round(_mean(sizes) or 0),
    )


def _pairs(results: Sequence[RequestResult], references: Sequence[RequestResult], field: str,
           turns: range | None = None) -> list[tuple[float, float]]:
    """(CLI value, reference value) of the same conversation and turn, both succeeded."""
    theirs = {(r.conversation, r.turn): getattr(r, field) for r in references if r.ok}
    return [(getattr(r, field), theirs[(r.conversation, r.turn)]) for r in results
            if r.ok and (turns is None or r.turn in turns) and getattr(r, field) is not None
            and theirs.get((r.conversation, r.turn)) is not None]


def _ratio(pairs: list[tuple[float, float]]) -> float | None:
    ours, theirs = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    return ours / theirs - 1.0 if pairs and theirs else None


def replay_summary(api: str, results: Sequence[RequestResult], references: Sequence[RequestResult]) -> ReplaySummary:
    """The ``--api`` figures: each side's per-turn stats and the front overhead of the CLI's surface."""
    cli, reference = _side(api, results), _side("chat", references)
    later = range(2, 1 << 30)
    paired = _pairs(results, references, "ttft", later)
    overhead = _ratio(paired)
    meets = {}
    if cli.ttft_ratio is not None:
        meets["ttft_ratio"] = cli.ttft_ratio <= TARGETS["ttft_ratio"]
    if cli.later_cached_share is not None:
        meets["cached_share"] = cli.later_cached_share >= TARGETS["cached_share"]
    if overhead is not None:
        meets["front_overhead"] = overhead <= TARGETS["front_overhead"]
    return ReplaySummary(
        api=api,
        cli=cli,
        reference=reference,
        front_overhead=overhead,
        front_overhead_s=_mean([a - b for a, b in paired]),
        front_overhead_median=percentile([a / b - 1.0 for a, b in paired if b], 50),
        first_turn_overhead=_ratio(_pairs(results, references, "ttft", range(1, 2))),
        latency_ratio=_ratio(_pairs(results, references, "latency")),
        targets=dict(TARGETS),
        meets=meets,
    )


def _speculation(counters: tuple[dict[str, float], dict[str, float]] | None, output: int) -> SpeculationStats | None:
    """The deltas of the engine counters (``/metrics`` before and after), or None."""
    if counters is None:
        return None
    before, after = counters
    delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    steps, blocks, accepted = delta.get("engine_steps", 0), delta.get("spec_verify_blocks", 0), delta.get(
        "spec_accepted_tokens", 0)
    return SpeculationStats(
        target_steps=steps,
        drafted_tokens=delta.get("spec_drafted_tokens", 0),
        accepted_tokens=accepted,
        verify_blocks=blocks,
        acceptance_length=round((accepted + blocks) / blocks, 3) if blocks else None,
        tokens_per_target_step=round(output / steps, 3) if steps else None,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def render(report: BenchReport, console: Console) -> None:
    """Draw ``report`` as rich tables on ``console``."""
    summary = Table(title=f"musegl bench: {report.workload} @ concurrency {report.concurrency}", show_header=False)
    summary.add_column("metric", style="bold")
    summary.add_column("value", justify="right")
    summary.add_row("requests (ok / errors)", f"{report.succeeded} / {report.errors}")
    summary.add_row("duration", f"{report.duration_s:.2f} s")
    summary.add_row("requests/s", f"{report.requests_per_s:.3f}")
    summary.add_row("output tokens/s", f"{report.output_tokens_per_s:.2f}")
    if report.tensor_parallel_size > 1:
        summary.add_row(f"output tokens/s per device ({report.tensor_parallel_size} devices)",
                        f"{report.output_tokens_per_s_per_device:.2f}")
    summary.add_row("output tokens", str(report.output_tokens))
    summary.add_row("prompt tokens (cached)", f"{report.prompt_tokens} ({report.cached_tokens})")
    summary.add_row("cached-token ratio", f"{report.cached_ratio:.1%}")
    for name, stats in (("TTFT", report.ttft), ("inter-token latency", report.itl), ("request latency", report.latency)):
        summary.add_row(f"{name} p50 / p95 / p99", f"{_ms(stats.p50)} / {_ms(stats.p95)} / {_ms(stats.p99)}")
    warm = report.warm
    if warm is not None and warm.warm_turns:
        summary.add_row("warm-turn TTFT p50 / p99", f"{_ms(warm.ttft.p50)} / {_ms(warm.ttft.p99)}")
        summary.add_row(f"sessions held (warm turns >= {WARM_SHARE:.0%} cached)",
                        f"{warm.sessions_held} of {warm.sessions} ({warm.warm_turns_held} of {warm.warm_turns} "
                        "warm turns)")
    spec = report.speculation
    if spec is not None and spec.target_steps:
        summary.add_row("output tokens per target step", f"{spec.tokens_per_target_step:.2f}")
        if spec.verify_blocks:
            summary.add_row("drafts accepted / drafted", f"{spec.accepted_tokens} / {spec.drafted_tokens}")
            summary.add_row("mean acceptance length", f"{spec.acceptance_length:.2f}")
    for kind, count in report.error_kinds.items():
        summary.add_row(f"error: {kind}", str(count), style="red")
    if report.sessions_deleted or report.sessions_left:
        summary.add_row("sessions deleted / left", f"{report.sessions_deleted} / {len(report.sessions_left)}")
    console.print(summary)
    for kind, message in report.error_messages.items():
        if message:
            console.print(f"[red]{escape(kind)}[/red]: {escape(message)}", highlight=False)
    for name, why in report.sessions_left.items():
        console.print(f"[yellow]session {escape(name)} was not deleted[/yellow]: {escape(why)}", highlight=False)
    if report.turns:
        turns = Table(title="agent turns")
        for column in ("turn", "requests", "TTFT p50", "TTFT p95", "prompt tokens", "cached"):
            turns.add_column(column, justify="right")
        for t in report.turns:
            ratio = f"{t.cached_tokens / t.prompt_tokens:.1%}" if t.prompt_tokens else "-"
            turns.add_row(str(t.turn), str(t.requests), _ms(t.ttft.p50), _ms(t.ttft.p95), str(t.prompt_tokens), ratio)
        console.print(turns)
    if report.replay is not None:
        _render_replay(report.replay, console)
    if report.sessions is not None:
        s = report.sessions
        table = Table(title=f"turn {s.turn}: session vs the same history anonymous", show_header=True)
        for column in ("", "requests", "TTFT mean", "TTFT p50"):
            table.add_column(column, justify="right")
        table.add_row("session", str(s.session_ttft.count), _ms(s.session_ttft.mean), _ms(s.session_ttft.p50))
        table.add_row("anonymous", str(s.anonymous_ttft.count), _ms(s.anonymous_ttft.mean), _ms(s.anonymous_ttft.p50))
        console.print(table)
        ratio = "-" if s.ratio is None else f"{s.ratio:.3f} (1/{1 / s.ratio:.1f})" if s.ratio else "0"
        console.print(f"session / anonymous TTFT: {ratio}")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _render_replay(replay: ReplaySummary, console: Console) -> None:
    table = Table(title=f"{replay.api} vs chat, the same conversation, interleaved")
    for column in ("turn", f"{replay.api} TTFT", "chat TTFT", f"{replay.api} prompt", f"{replay.api} cached",
                   "chat cached"):
        table.add_column(column, justify="right")
    theirs = {t.turn: t for t in replay.reference.turns}
    for t in replay.cli.turns:
        ref = theirs.get(t.turn)
        table.add_row(str(t.turn), _ms(t.ttft.mean), _ms(ref.ttft.mean if ref else None), str(t.prompt_tokens),
                      _share(t.cached_tokens / t.prompt_tokens if t.prompt_tokens else None),
                      _share(ref.cached_tokens / ref.prompt_tokens if ref and ref.prompt_tokens else None))
    console.print(table)
    summary = Table(title="targets (issue 27)", show_header=True)
    for column in ("figure", "measured", "target", "met"):
        summary.add_column(column, justify="right")
    rows = (("turn >= 2 TTFT / turn 1", replay.cli.ttft_ratio, "<= 0.2x", "ttft_ratio", "{:.3f}x"),
            ("cached share, turns >= 2", replay.cli.later_cached_share, ">= 90%", "cached_share", "{:.1%}"),
            (f"front overhead vs chat (TTFT, turns >= 2)", replay.front_overhead, "<= 5%", "front_overhead",
             "{:+.1%}"))
    for name, value, target, key, fmt in rows:
        met = replay.meets.get(key)
        summary.add_row(name, "-" if value is None else fmt.format(value), target,
                        "-" if met is None else "yes" if met else "no")
    console.print(summary)
    if replay.front_overhead_s is not None:
        console.print(f"front overhead: {replay.front_overhead_s * 1000:+.1f} ms per request (mean of paired "
                      f"turns), median ratio {_share(replay.front_overhead_median)}", highlight=False)

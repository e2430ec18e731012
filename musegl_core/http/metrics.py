"""``GET /metrics``: Prometheus text exposition, every name prefixed ``musegl_``.

Two sources:

* the **worker's engine counters** (KV pool, sessions, steps, running and
  waiting requests): the front asks for a fresh snapshot on each scrape
  (answered between two engine steps);
* the **front's own series** (:class:`FrontMetrics`): HTTP requests by
  endpoint and status, prompt / generated / cached tokens, and latency
  histograms (time to first token, inter-token latency, end-to-end latency,
  queue time), observed by :class:`MeteredWorker` as worker events pass.

Routers and autoscalers written for vLLM (vllm-router, llm-d's scheduler,
dashboards) read vLLM's series: the same quantities are also exported under
vLLM's names (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:time_to_first_token_seconds``, ...; :data:`VLLM_GAUGES` and
:class:`VllmSeries`), with vLLM's ``model_name`` label.

``docs/metrics.md`` lists every series.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from musegl_core.engine.prefix_miss import CAUSES as PREFIX_MISS_CAUSES
from musegl_core.http.request_log import CURRENT
from musegl_core.worker import messages as m

# Latency buckets in seconds: sub-millisecond steps to minute-long generations.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
            1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# engine stats key -> (metric name, help, kind)
SERIES = {
    "kv_blocks_total": ("kv_blocks", "KV cache blocks in the pool", "gauge"),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by sessions, snapshots and running requests", "gauge"),
    "kv_blocks_reserved": ("kv_blocks_reserved", "free KV blocks reserved by session slots", "gauge"),
    "kv_blocks_cached": ("kv_blocks_cached", "free KV blocks keeping a finished prefix for reuse (evicted LRU when needed)", "gauge"),
    "prefix_cache_hits": ("prefix_cache_hits", "requests that reused KV blocks from the prefix cache", "counter"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "prompt positions reused from the prefix cache", "counter"),
    "prefix_cache_evicted_blocks": ("prefix_cache_evicted_blocks", "cached KV blocks evicted to make room", "counter"),
    "sessions_moved_down": ("sessions_moved_down", "idle soft sessions moved to the host tier at their idle "
                            "timeout instead of closed", "counter"),
    "kv_disk_blocks": ("kv_disk_blocks", "KV blocks of this model and KV format in the disk tier", "gauge"),
    "kv_disk_retained_blocks": ("kv_disk_retained_blocks", "disk-tier blocks whose client-asked retention still "
                                "runs (evicted after the others)", "gauge"),
    "kv_disk_written_bytes": ("kv_disk_written_bytes", "bytes of KV blocks written to the disk tier", "counter"),
    "kv_disk_read_bytes": ("kv_disk_read_bytes", "bytes of KV blocks read back from the disk tier", "counter"),
    "kv_disk_evicted_blocks": ("kv_disk_evicted_blocks", "disk-tier block files deleted to stay within "
                               "--kv-offload-disk", "counter"),
    "kv_disk_corrupt_blocks": ("kv_disk_corrupt_blocks", "disk-tier block files that failed a check (truncated, "
                               "corrupt, another key or format): treated as misses and deleted", "counter"),
    "prefill_shared_tokens": ("prefill_shared_tokens", "prompt positions adopted from another running prompt's "
                              "prefill (shared prefill: computed once for prompts that arrived together)", "counter"),
    "prefill_shared_requests": ("prefill_shared_requests", "requests that adopted positions of another running "
                                "prompt's prefill", "counter"),
    "prefill_follow_steps": ("prefill_follow_steps", "steps x prompts that waited for the blocks an earlier prompt "
                             "was computing", "counter"),
    "kv_host_offloads": ("kv_host_offloads", "idle sessions and snapshots whose KV blocks moved to the host tier "
                         "(--kv-offload-memory)", "counter"),
    "kv_host_offloaded_blocks": ("kv_host_offloaded_blocks", "KV blocks copied from the device to the host tier",
                                 "counter"),
    "kv_host_restored_blocks": ("kv_host_restored_blocks", "KV blocks copied from the host tier back to the device",
                                "counter"),
    "kv_host_cached_blocks": ("kv_host_cached_blocks", "blocks of the prefix cache kept in the host tier", "gauge"),
    "kv_host_window_blocks": ("kv_host_window_blocks", "blocks whose sliding layers' pages, out of every window, "
                              "the host tier keeps for rewinds (--sliding-window-kv)", "gauge"),
    "kv_window_offloaded_blocks": ("kv_window_offloaded_blocks", "blocks whose sliding layers' pages were copied to "
                                   "the host tier as they left the window", "counter"),
    "kv_window_restores": ("kv_window_restores", "rewinds past the sliding window whose sliding pages came back "
                           "from the host tier (nothing recomputed)", "counter"),
    "kv_window_restored_blocks": ("kv_window_restored_blocks", "blocks whose sliding pages came back from the "
                                  "host tier for a rewind", "counter"),
    "kv_window_recomputed_rows": ("kv_window_recomputed_rows", "positions whose sliding layers' K/V a rewind past "
                                  "the window recomputed (their pages were in no tier)", "counter"),
    "kv_restores": ("kv_restores", "sessions, snapshots and prompts whose KV came back from the host tier", "counter"),
    "kv_restore_seconds": ("kv_restore_seconds", "seconds the engine spent bringing KV back from the host tier "
                           "(on CUDA: issuing the copies, which finish on a side stream)", "counter"),
    "kv_suspended": ("kv_suspended", "running requests suspended to the host tier when the device pool ran short "
                     "(their blocks copied down, the last admitted first; never recomputed)", "counter"),
    "kv_resumed": ("kv_resumed", "suspended requests resumed (their blocks copied back to the device)", "counter"),
    "kv_suspended_blocks": ("kv_suspended_blocks", "KV blocks of running requests copied to the host tier by "
                            "suspensions", "counter"),
    "kv_resumed_blocks": ("kv_resumed_blocks", "KV blocks of suspended requests copied back to the device",
                          "counter"),
    "kv_requests_suspended": ("kv_requests_suspended", "running requests suspended to the host tier now (their "
                              "streams pause)", "gauge"),
    "kv_pages_committed": ("kv_pages_committed", "KV pages the running requests may reach by their ends (blocks "
                           "on demand: the admission guarantee over device plus host)", "gauge"),
    "running": ("requests_running", "requests running in the engine", "gauge"),
    "waiting": ("requests_waiting", "requests in the admission queue (for a running place, a session slot or "
                "their session's previous request)", "gauge"),
    "queue_refused": ("requests_refused_queue_full", "requests refused with 503 server_busy: the admission queue "
                      "was full (--max-queued-requests)", "counter"),
    "named": ("sessions_resident", "named sessions resident in the worker", "gauge"),
    "idle": ("sessions_idle", "resident named sessions with no running or queued request", "gauge"),
    "expired": ("sessions_expired", "named sessions closed by --session-idle-timeout", "counter"),
    "closed": ("sessions_closed", "named sessions closed by DELETE /v1/sessions/{id}", "counter"),
    "anonymous": ("sessions_anonymous", "temporary slots held by anonymous requests", "gauge"),
    "snapshots": ("prefix_snapshots", "prefix snapshots held (--prefix-cache-entries)", "gauge"),
    "evictions": ("sessions_evicted", "idle sessions evicted to free a slot", "counter"),
    "steps": ("engine_steps", "executor steps run", "counter"),
    "steps_ahead": ("engine_steps_ahead", "decode steps launched before the previous step was read "
                    "(asynchronous executors)", "counter"),
    "discarded_rows": ("engine_discarded_rows", "rows of steps launched ahead whose sequence had stopped", "counter"),
    "preparing": ("requests_preparing", "requests being prepared (tokenized, images decoded) on the worker's "
                  "preparation threads", "gauge"),
    "preparing_heavy": ("requests_preparing_heavy", "requests being prepared in the heavy lane (images, long "
                        "prompts)", "gauge"),
    "prepared": ("requests_prepared", "requests whose preparation ended (handed to the engine or refused)", "counter"),
    "prepare_seconds": ("request_preparation_seconds", "seconds spent preparing requests, all preparation threads",
                        "counter"),
    "drafted_tokens": ("spec_drafted_tokens", "draft tokens a speculator proposed and the target verified", "counter"),
    "accepted_tokens": ("spec_accepted_tokens", "draft tokens the target accepted", "counter"),
    "verify_blocks": ("spec_verify_blocks", "decode steps of a sequence that verified drafts", "counter"),
    "budget_cut_steps": ("spec_budget_cut_steps", "steps whose drafts the verify-rows budget shortened "
                         "(--spec-verify-rows)", "counter"),
    "budget_skipped_steps": ("spec_budget_skipped_steps", "steps the verify-rows budget left without drafts "
                             "(more than half as many decoding sequences as --spec-verify-rows)", "counter"),
    "mask_seconds": ("grammar_mask_seconds", "seconds spent computing grammar masks (any thread)", "counter"),
    "mask_blocked_seconds": ("grammar_mask_blocked_seconds", "seconds the engine thread spent computing grammar "
                             "masks or waiting for them (the part on the critical path)", "counter"),
    "decode_steps": ("engine_decode_steps", "executor steps that only decoded", "counter"),
    "decode_step_seconds": ("engine_decode_step_seconds", "wall seconds of steps that only decoded", "counter"),
    "decode_step_decode_rows": ("engine_decode_step_decode_rows", "decode rows of steps that only decoded", "counter"),
    "mixed_steps": ("engine_mixed_steps", "executor steps carrying decodes and prefill chunks", "counter"),
    "mixed_step_seconds": ("engine_mixed_step_seconds", "wall seconds of mixed steps", "counter"),
    "mixed_step_decode_rows": ("engine_mixed_step_decode_rows", "decode rows of mixed steps", "counter"),
    "mixed_step_prefill_rows": ("engine_mixed_step_prefill_rows", "prefill rows of mixed steps", "counter"),
    "prefill_steps": ("engine_prefill_steps", "executor steps that only prefilled (nothing decoding)", "counter"),
    "prefill_step_seconds": ("engine_prefill_step_seconds", "wall seconds of prefill-only steps", "counter"),
    "prefill_step_prefill_rows": ("engine_prefill_step_prefill_rows", "prefill rows of prefill-only steps", "counter"),
}


#: vLLM's engine gauges: name -> (help, the value from one stats snapshot, or None when absent)
VLLM_GAUGES = {
    "vllm:num_requests_running": ("requests running in the engine (musegl_requests_running)",
                                  lambda v: v.get("running")),
    "vllm:num_requests_waiting": ("requests in the admission queue (musegl_requests_waiting)",
                                  lambda v: v.get("waiting")),
    "vllm:kv_cache_usage_perc": ("fraction of the KV pool's blocks holding K/V, 0-1 "
                                 "(musegl_kv_blocks_used / musegl_kv_blocks)",
                                 lambda v: v["kv_blocks_used"] / v["kv_blocks_total"]
                                 if v.get("kv_blocks_total") and "kv_blocks_used" in v else None),
}


#: the KV tiers, as SGLang's ``cache_source`` label spells them (disk: the tier below the host's)
TIERS = ("device", "host", "disk")


def tier_families(values: Mapping[str, float]) -> Iterable[Metric]:
    """Per-tier KV bytes and hits with a ``cache_source`` label, from the engine's
    ``kv_tier_*_<tier>`` stats (a tier the server does not have is left out)."""
    families = (
        ("kv_tier_bytes", GaugeMetricFamily, "KV bytes held in each tier"),
        ("kv_tier_capacity_bytes", GaugeMetricFamily, "KV bytes each tier can hold"),
        ("kv_tier_hits", CounterMetricFamily, "requests that reused KV positions from each tier"),
        ("kv_tier_hit_tokens", CounterMetricFamily, "prompt positions reused from each tier (cached tokens)"),
    )
    for key, family, help_text in families:
        present = [(tier, values[f"{key}_{tier}"]) for tier in TIERS if f"{key}_{tier}" in values]
        if present:
            metric = family(f"musegl_{key}", help_text, labels=["cache_source"])
            for tier, value in present:
                metric.add_metric([tier], float(value))
            yield metric


class _Snapshot:
    """A one-shot collector over one stats snapshot."""

    def __init__(self, values: Mapping[str, float], ready: bool, restarts: int, model_name: str = ""):
        self.values = values
        self.ready = ready
        self.restarts = restarts
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("musegl_worker_ready", "1 when the worker can generate", value=int(self.ready))
        yield CounterMetricFamily("musegl_worker_restarts", "times the worker was restarted", value=self.restarts)
        for key, (name, help_text, kind) in SERIES.items():
            if key in self.values:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(f"musegl_{name}", help_text, value=float(self.values[key]))
        for name, (help_text, read) in VLLM_GAUGES.items():
            value = read(self.values)
            if value is not None:
                gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
                gauge.add_metric([self.model_name], float(value))
                yield gauge
        yield from tier_families(self.values)
        blocks = self.values.get("verify_blocks")
        if blocks:
            accepted = self.values.get("accepted_tokens", 0)
            yield GaugeMetricFamily("musegl_spec_mean_acceptance_length",
                                    "tokens committed per verified block (accepted drafts + 1), since start",
                                    value=(accepted + blocks) / blocks)


class VllmSeries:
    """The front's series under vLLM's names (``model_name`` label), observed
    where their ``musegl_`` twins are; the prefix-cache counters count prompt
    tokens when generation starts, as vLLM counts them when it schedules a prompt."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r, model = registry, ("model_name",)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of finished requests", model, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated (by finished, cancelled and failed requests)",
                                         model, registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "prompt tokens looked up in the session and prefix caches", model,
                                            registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "prompt tokens reused from a session or the prefix cache", model,
                                         registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "from arrival to the first generated token",
                              model, buckets=_LATENCY, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "between consecutive generated tokens",
                             model, buckets=_LATENCY, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "from arrival to the last token (finished)",
                             model, buckets=_LATENCY, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "time in the admission queue", model,
                               buckets=_LATENCY, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "prefill time, less the queue time",
                                 model, buckets=_LATENCY, registry=r)


class FrontMetrics:
    """The front's series, in a registry of their own (one per application)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        #: the served model id, for the vLLM series' ``model_name`` label (set once it is known)
        self.model_name = ""
        self.vllm = VllmSeries(r)
        self.requests = Counter("musegl_http_requests", "HTTP requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=r)
        self.prompt_tokens = Counter("musegl_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("musegl_cached_prompt_tokens",
                                     "prompt tokens reused from a session or prefix cache", registry=r)
        self.prefix_misses = Counter("musegl_prefix_cache_miss",
                                     "requests that reused fewer prompt positions than the server held, by cause "
                                     "(docs/sessions.md)", ("cause",), registry=r)
        for cause in PREFIX_MISS_CAUSES:
            self.prefix_misses.labels(cause)
        self.generated_tokens = Counter("musegl_generated_tokens",
                                        "tokens generated (by finished, cancelled and failed requests)",
                                        registry=r)
        self.ttft = Histogram("musegl_time_to_first_token_seconds",
                              "from the request's arrival to its first generated token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("musegl_inter_token_latency_seconds",
                             "between consecutive generated tokens of a request", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("musegl_request_latency_seconds",
                             "from the request's arrival to its last token (finished requests)",
                             buckets=_LATENCY, registry=r)
        self.queue = Histogram("musegl_request_queue_seconds",
                               "time a request waited in the worker's admission queue before it ran",
                               buckets=_LATENCY, registry=r)
        self.prefill = Histogram("musegl_request_prefill_seconds",
                                 "from submission to the worker until the prompt is prefilled, less the queue time",
                                 buckets=_LATENCY, registry=r)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self, values: Mapping[str, float], *, ready: bool, restarts: int) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(values, ready, restarts, self.model_name))
        return generate_latest(registry) + generate_latest(self.registry)


class MeteredWorker:
    """A worker client seen through :class:`FrontMetrics`: same ``generate``
    contract, and every request's events are timed on their way through."""

    def __init__(self, worker: Any, metrics: FrontMetrics, arrived: float):
        self.worker = worker
        self.metrics = metrics
        self.arrived = arrived  # time.monotonic() when the HTTP request arrived

    @contextlib.asynccontextmanager
    async def generate(self, request: m.Generate) -> AsyncIterator[AsyncIterator[m.Event]]:
        async with self.worker.generate(request) as events:
            yield _Observed(events, self.metrics, self.arrived, time.monotonic())


class _Observed:
    """The events of one request, observed as they are read. A plain iterator
    rather than an async generator: closing or cancelling the reader acts on
    the worker's own iterator exactly as it would without metrics."""

    def __init__(self, events: AsyncIterator[m.Event], metrics: FrontMetrics, arrived: float, submitted: float):
        self._events = events
        self._metrics = metrics
        self._arrived = arrived
        self._submitted = submitted
        self._last: float | None = None  # when the latest token arrived
        self._seen = 0  # generated ids seen so far
        self._counted = 0  # generated ids counted in the metrics and the summary line
        self._record = CURRENT.get()  # the HTTP request's summary line (http/request_log.py), if any

    def __aiter__(self) -> "_Observed":
        return self

    async def __anext__(self) -> m.Event:
        event = await self._events.__anext__()
        now, metrics = time.monotonic(), self._metrics
        vllm, model = metrics.vllm, metrics.model_name
        if isinstance(event, m.Admitted) and event.prefix_miss is not None:
            metrics.prefix_misses.labels(event.prefix_miss.cause).inc()
            if self._record is not None:
                self._record.prefix_miss = event.prefix_miss
        if isinstance(event, m.Started):
            prefill = max(0.0, now - self._submitted - event.queue_seconds)
            metrics.queue.observe(event.queue_seconds)
            metrics.prefill.observe(prefill)
            vllm.queue.labels(model).observe(event.queue_seconds)
            vllm.prefill.labels(model).observe(prefill)
            vllm.prefix_cache_queries.labels(model).inc(event.prompt_tokens)
            vllm.prefix_cache_hits.labels(model).inc(event.cached_tokens)
            if self._record is not None:
                self._record.started_generating(event.prompt_tokens, event.cached_tokens, event.queue_seconds)
        elif isinstance(event, m.Tokens):
            self._tokens(len(event.ids), now)
            self._generated(len(event.ids))
        elif isinstance(event, m.Done):
            self._tokens(event.completion_tokens - self._seen, now)  # ids only Done reports (the end token)
            metrics.e2e.observe(now - self._arrived)
            metrics.prompt_tokens.inc(event.prompt_tokens)
            metrics.cached_tokens.inc(event.cached_tokens)
            vllm.e2e.labels(model).observe(now - self._arrived)
            vllm.prompt_tokens.labels(model).inc(event.prompt_tokens)
            self._generated(event.completion_tokens - self._counted)
        return event

    def _generated(self, count: int) -> None:
        """Count generated ids as they arrive, so that a request that ends early (its
        client went away, its stream failed) counts what it generated."""
        if count <= 0:
            return
        self._counted += count
        self._metrics.generated_tokens.inc(count)
        self._metrics.vllm.generation_tokens.labels(self._metrics.model_name).inc(count)
        if self._record is not None:
            self._record.finished(count)

    def _tokens(self, count: int, now: float) -> None:
        """``count`` ids arrived at ``now``: the first is the time to first token,
        each later one gets an equal share of the gap since the previous arrival
        (ids that came together with the first have no gap to measure)."""
        if count <= 0:
            return
        vllm, model = self._metrics.vllm, self._metrics.model_name
        if self._last is None:
            self._metrics.ttft.observe(now - self._arrived)
            vllm.ttft.labels(model).observe(now - self._arrived)
            if self._record is not None:
                self._record.first_token(now)
        else:
            for _ in range(count):
                self._metrics.itl.observe((now - self._last) / count)
                vllm.itl.labels(model).observe((now - self._last) / count)
        self._last, self._seen = now, self._seen + count

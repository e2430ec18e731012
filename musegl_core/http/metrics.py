"""``GET /metrics``: Prometheus text exposition of the worker's engine counters.

The counters live in the worker; the front asks for a fresh snapshot on each
scrape (answered between two engine steps) and renders it with
``prometheus_client`` under the ``musegl_`` prefix.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# engine stats key -> (metric name, help, kind)
SERIES = {
    "kv_blocks_total": ("kv_blocks", "KV cache blocks in the pool", "gauge"),
    "kv_blocks_used": ("kv_blocks_used", "KV cache blocks holding K/V", "gauge"),
    "kv_blocks_reserved": ("kv_blocks_reserved", "free KV blocks reserved by session slots", "gauge"),
    "running": ("requests_running", "requests running in the engine", "gauge"),
    "waiting": ("requests_waiting", "admitted requests waiting for their session", "gauge"),
    "named": ("sessions_resident", "named sessions resident in the worker", "gauge"),
    "anonymous": ("sessions_anonymous", "temporary slots held by anonymous requests", "gauge"),
    "snapshots": ("prefix_snapshots", "prefix snapshots held (--prefix-cache-entries)", "gauge"),
    "evictions": ("sessions_evicted", "idle sessions evicted to free a slot", "counter"),
    "steps": ("engine_steps", "executor steps run", "counter"),
    "drafted_tokens": ("spec_drafted_tokens", "draft tokens a speculator proposed and the target verified", "counter"),
    "accepted_tokens": ("spec_accepted_tokens", "draft tokens the target accepted", "counter"),
    "verify_blocks": ("spec_verify_blocks", "decode steps of a sequence that verified drafts", "counter"),
}


class _Snapshot:
    """A one-shot collector over one stats snapshot."""

    def __init__(self, values: Mapping[str, float], ready: bool, restarts: int):
        self.values = values
        self.ready = ready
        self.restarts = restarts

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("musegl_worker_ready", "1 when the worker can generate", value=int(self.ready))
        yield CounterMetricFamily("musegl_worker_restarts", "times the worker was restarted", value=self.restarts)
        for key, (name, help_text, kind) in SERIES.items():
            if key in self.values:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                yield family(f"musegl_{name}", help_text, value=float(self.values[key]))
        blocks = self.values.get("verify_blocks")
        if blocks:
            accepted = self.values.get("accepted_tokens", 0)
            yield GaugeMetricFamily("musegl_spec_mean_acceptance_length",
                                    "tokens committed per verified block (accepted drafts + 1), since start",
                                    value=(accepted + blocks) / blocks)


def render(values: Mapping[str, float], *, ready: bool, restarts: int) -> bytes:
    """The Prometheus text for one snapshot (``values`` empty while the worker is down)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(values, ready, restarts))
    return generate_latest(registry)

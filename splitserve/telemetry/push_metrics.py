"""KV push activity on a worker's ``/metrics``: the push counters its GetStats returns (``kv_push*`` keys of the
prefill and decode workers' ``stats()``), read at scrape time.

Prefill side: ``splitserve:kv_pushes_total`` (pushes whose KV landed in a decode worker's blocks),
``splitserve:kv_push_fallbacks_total`` (pushes that could not complete: the KV was held for a pull instead),
``splitserve:kv_pushes_pending`` (gauge: push subscriptions open on the KV sender). Decode side:
``splitserve:kv_pushes_received_total``. A worker whose role can change exposes both.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry

from splitserve.telemetry.stats_collector import StatsCollector, register_stats

PUSH_GAUGES = frozenset({"pushes_pending"})


def push_counters(stats: dict[str, float]) -> dict[str, float]:
    """The ``kv_push*`` entries of a worker's ``stats()``, without their ``kv_`` prefix."""
    return {k.removeprefix("kv_"): v for k, v in stats.items() if k.startswith("kv_push")}


def register_push_stats(*reads: Callable[[], dict[str, float]], registry: CollectorRegistry = REGISTRY) -> StatsCollector:
    """Expose the push counters of ``reads`` (workers' ``stats`` methods) as ``splitserve:kv_push*``."""
    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for r in reads:
            out.update(push_counters(r()))
        return out

    return register_stats("kv", read, PUSH_GAUGES, doc="KV push", registry=registry)

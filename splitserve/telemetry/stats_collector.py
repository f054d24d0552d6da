"""Expose a component's plain counter dict (the same one its GetStats RPC returns) on /metrics.

Each key ``k`` becomes ``splitserve:<prefix>_<k>``, read at scrape time: keys in ``gauges`` are
gauges (they go up and down), every other key is a counter (monotonic totals, ``_total`` suffix
added by the text format).
"""

from __future__ import annotations

import re
from typing import Callable

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_BAD = re.compile(r"[^a-zA-Z0-9_]")


class StatsCollector:
    def __init__(self, prefix: str, read: Callable[[], dict[str, float]], gauges: frozenset[str], doc: str) -> None:
        self.prefix = prefix
        self.read = read
        self.gauges = gauges
        self.doc = doc

    def collect(self):
        for key, value in sorted(self.read().items()):
            name = f"splitserve:{self.prefix}_{_BAD.sub('_', key)}"
            family = GaugeMetricFamily if key in self.gauges else CounterMetricFamily
            yield family(name, f"{self.doc}: {key}", value=float(value))


def register_stats(prefix: str, read: Callable[[], dict[str, float]], gauges: set[str] | frozenset[str] = frozenset(),
                   doc: str = "KV store", registry: CollectorRegistry = REGISTRY) -> StatsCollector:
    """Register ``read()`` (key -> number) under ``splitserve:<prefix>_*`` on ``registry``."""
    collector = StatsCollector(prefix, read, frozenset(gauges), doc)
    registry.register(collector)
    return collector

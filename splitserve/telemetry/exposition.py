"""Serving ``/metrics``: the workers' HTTP server and gauges read from the engine at scrape time."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from splitserve.telemetry.metrics import expose

logger = logging.getLogger(__name__)


def check_metrics_port(port: int) -> None:
    """``--metrics-port``: a TCP port, 0 for any free port, -1 for no metrics server.

    Raises:
        ValueError: anything else.
    """
    if not -1 <= port <= 65535:
        raise ValueError(f"metrics_port must be -1 (off), 0 (any free port) or a TCP port, got {port}")


@dataclass
class MetricsServer:
    """A running ``GET /metrics`` HTTP server (Prometheus text format) on a daemon thread."""

    host: str
    port: int
    _httpd: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` (any path answers); port 0 = any free port,
    -1 = none (returns None). Raises ValueError for a bad port, OSError if it cannot bind."""
    check_metrics_port(port)
    if port < 0:
        return None
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host, httpd.server_port, httpd)


class EngineCollector:
    """Engine state read at scrape time: queues, KV blocks, step and token counters.

    ``gauges`` adds more: metric name -> (help, zero-argument function returning the value). The
    values are plain int reads of engine state from the scraper's thread (no lock: a scrape may be
    one step stale, never inconsistent in a way that matters for monitoring).
    """

    def __init__(self, engine, gauges: dict[str, tuple[str, Callable[[], float]]] | None = None) -> None:
        self.engine = engine
        self.gauges = dict(gauges or {})

    def collect(self):
        bm = self.engine.block_manager
        core = self.engine.core
        sched = core.scheduler
        total, free = bm.num_blocks, bm.num_free
        yield GaugeMetricFamily("splitserve:num_requests_running", "Requests in the engine's running batch.", value=len(sched.running))
        yield GaugeMetricFamily("splitserve:num_requests_waiting", "Requests waiting to be scheduled.", value=len(sched.waiting))
        yield GaugeMetricFamily("splitserve:kv_blocks_used", "KV cache blocks in use.", value=total - free)
        yield GaugeMetricFamily("splitserve:kv_blocks_free", "Free KV cache blocks.", value=free)
        yield GaugeMetricFamily("splitserve:kv_cache_usage_perc", "KV cache usage (fraction of blocks in use, 0-1).", value=(total - free) / total)
        yield CounterMetricFamily("splitserve:engine_steps", "Engine forward steps.", value=core.num_steps)
        yield CounterMetricFamily("splitserve:engine_prefill_tokens", "Tokens run through prefill steps.", value=core.num_prefill_tokens)
        yield CounterMetricFamily("splitserve:engine_decode_tokens", "Tokens produced by decode steps.", value=core.num_decode_tokens)
        adm = core.admission
        yield GaugeMetricFamily("splitserve:num_kv_allocations_waiting", "KV block allocations (e.g. for incoming KV) waiting for free blocks.",
                                value=len(adm.waiters))
        yield CounterMetricFamily("splitserve:kv_block_waits", "Requests and block allocations that had to wait for free KV blocks.",
                                  value=adm.num_block_waits + sched.num_block_waits)
        yield CounterMetricFamily("splitserve:queue_timeouts", "Requests and block allocations that waited max_queue_wait_s and failed.",
                                  value=adm.num_timed_out)
        yield CounterMetricFamily("splitserve:queue_refused", "Requests and block allocations refused: max_queue_len were waiting.",
                                  value=adm.num_refused)
        for name, (doc, read) in self.gauges.items():
            yield GaugeMetricFamily(name, doc, value=read())


def register_engine(engine, registry: CollectorRegistry = REGISTRY,
                    gauges: dict[str, tuple[str, Callable[[], float]]] | None = None) -> EngineCollector:
    """Expose ``engine`` (an AsyncEngine) on ``registry``; see :class:`EngineCollector`."""
    collector = EngineCollector(engine, gauges)
    registry.register(collector)
    return collector


WORKER_GROUPS = {"prefill": ("prefill", "transfer", "store"), "decode": ("decode", "transfer", "store")}


def start_worker_metrics(role: str, engine, host: str, port: int, gauges=None) -> MetricsServer | None:
    """Everything a worker needs for ``/metrics``: its metric groups, the engine's gauges and the HTTP
    server (see :func:`start_metrics_server` for ``port``). Returns the server or None (port -1).

    Raises:
        ValueError: unknown ``role`` (``prefill``, ``decode``) or a bad port.
    """
    if role not in WORKER_GROUPS:
        raise ValueError(f"unknown worker role {role!r}; known: {', '.join(WORKER_GROUPS)}")
    check_metrics_port(port)
    expose(*WORKER_GROUPS[role])
    register_engine(engine, gauges=gauges)
    return start_metrics_server(host, port)

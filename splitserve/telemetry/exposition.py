"""Serving ``/metrics``: the workers' HTTP server and gauges read from the engine at scrape time."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIRequestHandler, make_server
from typing import Any, Callable

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
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


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry = REGISTRY, *, read_timeout_s: float | None = None,
    max_connections: int | None = None,
) -> MetricsServer | None:
    """Serve ``registry`` on ``http://host:port/metrics`` (any path answers); port 0 = any free port,
    -1 = none (returns None). A connection idle or half-sent for ``read_timeout_s`` (default
    ``METRICS_READ_TIMEOUT_S``) is closed; beyond ``max_connections`` (default ``METRICS_MAX_CONNECTIONS``)
    at once, connections get 503. Raises ValueError for a bad port, OSError if it cannot bind."""
    check_metrics_port(port)
    if port < 0:
        return None
    server_class = _MetricsHTTPServer6 if ":" in host else _MetricsHTTPServer
    httpd = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_MetricsHandler)
    httpd.read_timeout_s = METRICS_READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
    httpd.slots = threading.BoundedSemaphore(max_connections or METRICS_MAX_CONNECTIONS)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return MetricsServer(host, httpd.server_port, httpd)


#: a metrics connection that sends nothing (or half a request) for this long is closed (s)
METRICS_READ_TIMEOUT_S = 10.0
#: metrics connections served at once; more are answered 503 and closed (each one is a thread)
METRICS_MAX_CONNECTIONS = 32


class _MetricsHandler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # socket timeout: idle, half-sent and slow clients are dropped
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not logged
        pass


class _MetricsHTTPServer(ThreadingWSGIServer):
    """prometheus_client's threading WSGI server with a cap on the connections served at once."""

    read_timeout_s: float = METRICS_READ_TIMEOUT_S
    slots: threading.BoundedSemaphore

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (TimeoutError, ConnectionError)):
            return  # an idle, half-sent or vanished scraper, closed by the read timeout: not an error
        logger.warning("metrics request from %s failed", client_address, exc_info=True)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _MetricsHTTPServer6(_MetricsHTTPServer):
    address_family = socket.AF_INET6


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


WORKER_GROUPS = {"prefill": ("prefill", "transfer", "store"), "decode": ("decode", "transfer", "store"),
                 "elastic": ("prefill", "decode", "transfer", "store")}  # `splitserve worker`: role can change


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

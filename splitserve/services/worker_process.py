"""What a prefill or decode worker process does around its servicer, in one place: keepalive settings, torch
threads, model and engine; the gRPC server (health, keepalive, draining) and ``/metrics``; readiness; and the
graceful shutdown (:mod:`splitserve.rpc.shutdown`: NOT_SERVING at once, new work refused with UNAVAILABLE,
in-flight calls finish within ``config.shutdown_grace_s``, then everything is closed in order).

``config`` is a :class:`~splitserve.services.worker_config.WorkerConfig` (a prefill or decode worker's config);
only its shared fields are used here.
"""

from __future__ import annotations

import gc
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import grpc
from grpc_health.v1 import health

from splitserve.cpus import pin_process
from splitserve.engine.async_engine import AsyncEngine, set_torch_threads
from splitserve.engine.faults import apply_engine_faults
from splitserve.model import load_model
from splitserve.rpc import keepalive
from splitserve.rpc.server import bind, create_server, set_serving
from splitserve.rpc.shutdown import Drain, serve_until_signalled
from splitserve.telemetry.exposition import MetricsServer, start_worker_metrics
from splitserve.telemetry.stats_log import start_stats_log

if TYPE_CHECKING:
    from splitserve.services.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


async def start_engine(config: WorkerConfig) -> tuple[Any, AsyncEngine]:
    """Apply the process settings, load the model and start the engine thread. Returns (model, engine)."""
    keepalive.configure(config.keepalive)
    set_torch_threads(config.torch_threads, pin_process(config.cpus))
    lm = load_model(config.model, dtype=config.engine.dtype, device=config.engine.device)
    engine = AsyncEngine(lm, config.engine)
    apply_engine_faults(engine)  # tests only (PD_FAULT_STEP_DELAY_MS)
    await engine.start()
    return lm, engine


@dataclass
class WorkerServer:
    """A started worker gRPC server with its health service, drain state and ``/metrics`` endpoint."""

    role: str  # "prefill" | "decode"
    service: str  # full gRPC service name, e.g. "pd.v1.DecodeService"
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    drain: Drain
    port: int  # bound gRPC port
    metrics: MetricsServer | None
    engine: AsyncEngine | None = None  # its one-line stats are logged while serving
    extra_services: tuple[str, ...] = ()  # more services of the process (health SERVING / NOT_SERVING with ``service``)

    @classmethod
    async def start(cls, role: str, service: str, work_method: str, add_servicer: Callable, servicer: object,
                    engine: AsyncEngine, config: WorkerConfig, gauges: dict | None = None) -> "WorkerServer":
        """Serve ``servicer`` (``add_servicer(servicer, server)``) on ``config.host:config.port``; calls of
        ``work_method`` (e.g. ``"Decode"``) are the ones a shutdown drains."""
        drain = Drain()
        server, health_servicer = create_server(drain=drain, work_methods=[f"/{service}/{work_method}"])
        add_servicer(servicer, server)
        port = bind(server, config.host, config.port, config.tls)
        await server.start()
        metrics = start_worker_metrics(role, engine, config.host, config.metrics_port, gauges=gauges)
        return cls(role, service, server, health_servicer, drain, port, metrics, engine)

    async def serve(self, config: WorkerConfig, *, busy: Callable[[], bool] | None = None, closers: list[Callable] = ()) -> None:
        """SERVING until SIGTERM/SIGINT, then drain (waiting also while ``busy()``), stop, and call ``closers``
        (sync or async) in order; a closer that fails is logged and the next ones still run."""
        services = [self.service, *self.extra_services]
        gc.collect()  # start-up objects (model, tokenizer, servers) to the permanent generation: the collections that
        gc.freeze()  # allocation triggers during decode steps stop walking them (~10% of a small model's step)
        await set_serving(self.health, services)
        stats_log = start_stats_log(f"{self.role} worker", self.engine.stats, config.stats_log_interval_s) if self.engine else None
        try:
            await serve_until_signalled(self.server, self.health, services, self.drain,
                                        grace_s=config.shutdown_grace_s, name=f"{self.role} worker", busy=busy)
        finally:
            if stats_log is not None:
                stats_log.cancel()
            for close in [*([self.metrics.close] if self.metrics else []), *closers]:
                try:
                    result = close()
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    logger.exception("%s worker: closing %r failed", self.role, close)
            logger.info("%s worker stopped", self.role)

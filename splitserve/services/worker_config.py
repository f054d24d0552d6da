"""Settings every engine worker (prefill or decode) has: :class:`WorkerConfig`, and the CLI flags that fill it.

:class:`~splitserve.services.prefill.config.PrefillConfig` and
:class:`~splitserve.services.decode.config.DecodeConfig` extend it with their own fields;
:mod:`splitserve.services.worker_process` needs only these.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from splitserve.config_checks import check_port
from splitserve.cpus import check_cpus
from splitserve.engine.args import add_engine_args, engine_config
from splitserve.engine.config import EngineConfig
from splitserve.env import env_int, env_str
from splitserve.kvstore.config import StoreClientConfig, add_store_args, store_config
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config
from splitserve.rpc.shutdown import DEFAULT_GRACE_S, add_shutdown_args, check_grace
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.telemetry.exposition import check_metrics_port
from splitserve.telemetry.stats_log import add_stats_log_arg


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Attributes:

    model: HF folder, ``.gguf`` file or ``synthetic:<name>``.
    host, port: the gRPC control address (port 0: any free port).
    transport: KV transfer backend ("ucx"; "inproc" in tests).
    torch_threads: intra-op threads of this process's torch.
    cpus: CPU list every thread of the process is pinned to (``--cpus``, e.g. "0,2-3"); "" = not pinned.
    metrics_port: HTTP GET /metrics (Prometheus) on host:metrics_port; 0 = any free port, -1 = off.
    engine, store, tls, keepalive: the engine (KV pool, batching), KV store client, gRPC TLS and keepalive settings.
    shutdown_grace_s: on SIGTERM, in-flight calls may finish within this many seconds (0: stop at once).
    stats_log_interval_s: seconds between the one-line engine stats logs (``telemetry.stats_log``); 0: off.

    Raises:
        ValueError: a port outside [0, 65535], a bad metrics port, a negative grace period or a CPU list this
            process may not run on (the message names the flag).
    """

    model: str
    host: str = "127.0.0.1"
    port: int = 0
    transport: str = "ucx"
    torch_threads: int = 1
    cpus: str = ""
    metrics_port: int = 0
    engine: EngineConfig = EngineConfig()
    store: StoreClientConfig = StoreClientConfig()
    tls: TlsConfig = TlsConfig()
    keepalive: KeepaliveConfig = KeepaliveConfig()  # gRPC PINGs: hung peers detected
    shutdown_grace_s: float = DEFAULT_GRACE_S
    stats_log_interval_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.stats_log_interval_s >= 0:
            raise ValueError(f"--stats-log-interval-s must be >= 0 (0: off), got {self.stats_log_interval_s}")
        check_metrics_port(self.metrics_port)
        check_port("--port", self.port)
        check_grace(self.shutdown_grace_s)
        if self.cpus:
            check_cpus(self.cpus)


def add_worker_args(ap: argparse.ArgumentParser, *, port_env: str, port: int, prefix_caching: bool = True) -> None:
    """The flags of every :class:`WorkerConfig` field; ``--port`` defaults to ``$port_env`` or ``port``,
    ``--enable-prefix-caching`` to ``prefix_caching``."""
    add_engine_args(ap, prefix_caching=prefix_caching)
    ap.add_argument("--host", default=env_str("PD_HOST", "127.0.0.1"), help="address the gRPC server listens on")
    ap.add_argument("--port", type=int, default=env_int(port_env, port), help=f"gRPC port ({port_env}; 0: any free port)")
    add_store_args(ap)
    ap.add_argument("--metrics-port", type=int, default=env_int("PD_METRICS_PORT", 0), help="HTTP /metrics port; 0 = any free, -1 = off")
    add_tls_args(ap)
    add_keepalive_args(ap)
    add_shutdown_args(ap)
    add_stats_log_arg(ap)


def worker_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The :class:`WorkerConfig` keyword arguments from flags that :func:`add_worker_args` added."""
    return dict(
        model=a.model, host=a.host, port=a.port, transport=a.transport, torch_threads=a.torch_threads, cpus=a.cpus,
        metrics_port=a.metrics_port, engine=engine_config(a), store=store_config(a), tls=tls_config(a),
        keepalive=keepalive_config(a), shutdown_grace_s=a.shutdown_grace_s, stats_log_interval_s=a.stats_log_interval_s,
    )

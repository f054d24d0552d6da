"""Prefill worker settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.config_checks import check_port
from splitserve.engine.args import add_engine_args, engine_config
from splitserve.engine.config import EngineConfig
from splitserve.errors import InvalidRequest
from splitserve.kvstore.config import StoreClientConfig, add_store_args, store_config
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config
from splitserve.rpc.shutdown import DEFAULT_GRACE_S, add_shutdown_args, check_grace
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.telemetry.exposition import check_metrics_port
from splitserve.transfer.common import parse_endpoint


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    model: str
    host: str = "127.0.0.1"  # gRPC control address
    port: int = 50061
    data_host: str = "127.0.0.1"  # address advertised for KV pulls
    data_port: int = 0  # 0 = any free port
    data_advertise: str | None = None  # "host:port" put in KV handles instead of data_host:<bound port> (NAT)
    transport: str = "ucx"
    kv_lease_s: float = 30.0  # KV blocks are freed if no decode worker pulls them within this time
    torch_threads: int = 1
    metrics_port: int = 0  # HTTP GET /metrics (Prometheus) on host:metrics_port; 0 = any free port, -1 = off
    engine: EngineConfig = EngineConfig()
    store: StoreClientConfig = StoreClientConfig()
    tls: TlsConfig = TlsConfig()
    keepalive: KeepaliveConfig = KeepaliveConfig()  # gRPC PINGs: hung peers detected
    shutdown_grace_s: float = DEFAULT_GRACE_S  # SIGTERM: in-flight calls may finish within this (0: stop at once)

    def __post_init__(self) -> None:
        check_metrics_port(self.metrics_port)
        check_port("--port", self.port)
        check_port("--data-port", self.data_port)
        check_grace(self.shutdown_grace_s)
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if self.data_advertise:
            try:
                parse_endpoint(self.data_advertise)
            except InvalidRequest as exc:
                raise ValueError(f"data_advertise: {exc}") from None


def parse(argv: list[str] | None = None) -> PrefillConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="splitserve prefill", description="Run a prefill worker.")
    add_engine_args(ap)
    ap.add_argument("--host", default=env("PD_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("PD_PREFILL_PORT", "50061")))
    ap.add_argument("--data-host", default=env("PD_DATA_HOST", "127.0.0.1"))
    ap.add_argument("--data-port", type=int, default=int(env("PD_DATA_PORT", "0")))
    ap.add_argument("--data-advertise", default=env("PD_DATA_ADVERTISE") or None,
                    help="host:port decode workers pull KV from, when it differs from the listening address (NAT)")
    ap.add_argument("--kv-lease-s", type=float, default=float(env("PD_KV_LEASE_S", "30")))
    add_store_args(ap)
    ap.add_argument("--metrics-port", type=int, default=int(env("PD_METRICS_PORT", "0")), help="HTTP /metrics port; 0 = any free, -1 = off")
    add_tls_args(ap)
    add_keepalive_args(ap)
    add_shutdown_args(ap)
    a = ap.parse_args(argv)
    return PrefillConfig(
        model=a.model, host=a.host, port=a.port, data_host=a.data_host, data_port=a.data_port,
        data_advertise=a.data_advertise, transport=a.transport, kv_lease_s=a.kv_lease_s,
        torch_threads=a.torch_threads, metrics_port=a.metrics_port, engine=engine_config(a),
        store=store_config(a), tls=tls_config(a), keepalive=keepalive_config(a), shutdown_grace_s=a.shutdown_grace_s,
    )

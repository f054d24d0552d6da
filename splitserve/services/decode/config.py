"""Decode worker settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from splitserve.config_checks import check_port
from splitserve.engine.args import add_engine_args, engine_config
from splitserve.engine.config import EngineConfig
from splitserve.kvstore.config import StoreClientConfig, add_store_args, store_config
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config
from splitserve.rpc.shutdown import DEFAULT_GRACE_S, add_shutdown_args, check_grace
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.telemetry.exposition import check_metrics_port


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 50071
    transport: str = "ucx"
    kv_transfer_timeout_s: float = 10.0  # a KV pull that takes longer fails (then kv_transfer_failure applies)
    kv_transfer_failure: str = "fallback"  # "fallback": recompute the prompt here; "error": fail the request
    kv_checksum: bool = False  # verify an xxh3-64 checksum of every pulled transfer
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
        check_grace(self.shutdown_grace_s)
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.kv_transfer_failure not in ("fallback", "error"):
            raise ValueError(f"kv_transfer_failure must be 'fallback' or 'error', got {self.kv_transfer_failure!r}")


def parse(argv: list[str] | None = None) -> DecodeConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="splitserve decode", description="Run a decode worker.")
    add_engine_args(ap)
    ap.add_argument("--host", default=env("PD_HOST", "127.0.0.1"))
    ap.add_argument("--port", type=int, default=int(env("PD_DECODE_PORT", "50071")))
    ap.add_argument("--kv-transfer-timeout-s", type=float, default=float(env("PD_KV_TRANSFER_TIMEOUT_S", "10")))
    ap.add_argument("--kv-transfer-failure", choices=["fallback", "error"], default=env("PD_KV_TRANSFER_FAILURE", "fallback"),
                    help="when a KV pull fails: recompute the prompt here (fallback) or fail the request (error)")
    ap.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction,
                    default=env("PD_KV_CHECKSUM", "0").lower() in ("1", "true", "yes", "on"),
                    help="verify an xxh3-64 checksum of every pulled KV transfer (mismatch: as a failed pull)")
    add_store_args(ap)
    ap.add_argument("--metrics-port", type=int, default=int(env("PD_METRICS_PORT", "0")), help="HTTP /metrics port; 0 = any free, -1 = off")
    add_tls_args(ap)
    add_keepalive_args(ap)
    add_shutdown_args(ap)
    a = ap.parse_args(argv)
    return DecodeConfig(
        model=a.model, host=a.host, port=a.port, transport=a.transport,
        kv_transfer_timeout_s=a.kv_transfer_timeout_s, kv_transfer_failure=a.kv_transfer_failure,
        kv_checksum=a.kv_checksum, torch_threads=a.torch_threads, metrics_port=a.metrics_port, engine=engine_config(a),
        store=store_config(a), tls=tls_config(a), keepalive=keepalive_config(a), shutdown_grace_s=a.shutdown_grace_s,
    )

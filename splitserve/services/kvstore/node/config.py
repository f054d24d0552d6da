"""Storage node settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.env import env_float, env_int, env_str
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.config_checks import check_port
from splitserve.telemetry.exposition import check_metrics_port
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Attributes:

    master: gRPC address of the KV store master, "host:port".
    node_id: unique per node process (default: a random id; a restarted node mounts a fresh segment).
    segment_mb: size of the memory segment this node contributes, MiB (preallocated at start).
    host, port: gRPC control address (health + stats). data_host, data_port: UCX data endpoint.
    io_timeout_s: a read or write of object bytes that takes longer fails (the connection is aborted).
    rpc_timeout_s: deadline of each call to the master.
    tls: TLS (optionally mutual) of the gRPC server and of the channel to the master (``splitserve.rpc.tls``).
        The UCX data endpoint is not encrypted.
    """

    master: str
    node_id: str
    segment_mb: int = 256
    host: str = "127.0.0.1"
    port: int = 50091
    data_host: str = "127.0.0.1"
    data_port: int = 0
    io_timeout_s: float = 30.0
    rpc_timeout_s: float = 5.0
    metrics_port: int = 0  # HTTP GET /metrics (Prometheus); 0 = any free port, -1 = off
    tls: TlsConfig = TlsConfig()
    keepalive: KeepaliveConfig = KeepaliveConfig()  # gRPC PINGs: hung peers detected

    def __post_init__(self) -> None:
        if not self.master or not self.node_id:
            raise ValueError("a storage node needs --master and a node id")
        check_port("--port", self.port)
        check_port("--data-port", self.data_port)
        check_metrics_port(self.metrics_port)
        if self.segment_mb < 1:
            raise ValueError(f"segment_mb must be >= 1, got {self.segment_mb}")
        if self.io_timeout_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


def parse(argv: list[str] | None = None) -> NodeConfig:
    ap = new_parser("splitserve kvstore-node", "Run a KV store storage node.")
    ap.add_argument("--master", default=env_str("PD_KVSTORE_MASTER", "127.0.0.1:50090"), help="master gRPC host:port")
    ap.add_argument("--node-id", default=env_str("PD_KVSTORE_NODE_ID") or f"node-{uuid.uuid4().hex[:8]}",
                    help="unique id of this node (default: $PD_KVSTORE_NODE_ID, else a random node-<8 hex digits>)")
    ap.add_argument("--segment-mb", type=int, default=env_int("PD_KVSTORE_SEGMENT_MB", 256),
                    help="memory segment this node contributes, MiB (allocated at start)")
    ap.add_argument("--host", default=env_str("PD_HOST", "127.0.0.1"), help="address the gRPC server listens on")
    ap.add_argument("--port", type=int, default=env_int("PD_KVSTORE_NODE_PORT", 50091), help="gRPC port (0: any free port)")
    ap.add_argument("--data-host", default=env_str("PD_DATA_HOST", "127.0.0.1"), help="address of the UCX data endpoint")
    ap.add_argument("--data-port", type=int, default=env_int("PD_KVSTORE_DATA_PORT", 0), help="UCX data port (0: any free port)")
    ap.add_argument("--io-timeout-s", type=float, default=env_float("PD_KVSTORE_NODE_IO_TIMEOUT_S", 30.0),
                    help="seconds one read or write of object bytes may take before its connection is aborted")
    ap.add_argument("--metrics-port", type=int, default=env_int("PD_METRICS_PORT", 0), help="HTTP /metrics port; 0 = any free, -1 = off")
    add_tls_args(ap)
    add_keepalive_args(ap)
    a = ap.parse_args(argv)
    return NodeConfig(master=a.master, node_id=a.node_id, segment_mb=a.segment_mb, host=a.host, port=a.port,
                      data_host=a.data_host, data_port=a.data_port, io_timeout_s=a.io_timeout_s, metrics_port=a.metrics_port,
                      tls=tls_config(a), keepalive=keepalive_config(a))

"""KV store master settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.env import env_float, env_int, env_str
from splitserve.rpc.tls import TlsConfig, add_tls_args, tls_config
from splitserve.config_checks import check_port
from splitserve.telemetry.exposition import check_metrics_port
from splitserve.rpc.keepalive import KeepaliveConfig, add_keepalive_args, keepalive_config


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Attributes (times in seconds):

    default_replicas: copies of an object on distinct storage nodes when a put asks for 0.
    lease_s: read lease granted by GetReplicaList (blocks Remove and eviction).
    put_timeout_s: a PutStart without PutEnd/PutRevoke for this long is a zombie write; its space is
        reclaimed and a new PutStart of the key may proceed.
    heartbeat_interval_s: how often storage nodes heartbeat.
    heartbeat_timeout_s: a node silent this long is declared dead and its replicas are dropped.
    evict_high, evict_low: eviction starts when a put would fill a segment above ``evict_high`` of its
        capacity and frees least recently used objects down to ``evict_low``.
    tick_s: period of the background sweep (dead nodes, zombie writes).
    alignment: replicas are placed at multiples of this many bytes.
    max_object_bytes, max_key_bytes, max_batch: request limits (larger is INVALID).
    tls: TLS (optionally mutual) of the gRPC server (``splitserve.rpc.tls``; off when empty).
    """

    host: str = "127.0.0.1"
    port: int = 50090
    default_replicas: int = 1
    lease_s: float = 5.0
    put_timeout_s: float = 30.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    evict_high: float = 0.9
    evict_low: float = 0.8
    tick_s: float = 0.2
    alignment: int = 64
    max_object_bytes: int = 1 << 30
    max_key_bytes: int = 256
    max_batch: int = 65536
    metrics_port: int = 0  # HTTP GET /metrics (Prometheus); 0 = any free port, -1 = off
    tls: TlsConfig = TlsConfig()
    keepalive: KeepaliveConfig = KeepaliveConfig()  # gRPC PINGs: hung peers detected

    def __post_init__(self) -> None:
        check_port("--port", self.port)
        check_metrics_port(self.metrics_port)
        if not 1 <= self.default_replicas <= 16:
            raise ValueError(f"default_replicas must be in [1, 16], got {self.default_replicas}")
        for name in ("lease_s", "put_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "tick_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must be longer than heartbeat_interval_s")
        if not 0 < self.evict_low <= self.evict_high <= 1:
            raise ValueError(f"need 0 < evict_low <= evict_high <= 1, got {self.evict_low}, {self.evict_high}")
        if self.alignment < 1 or self.max_object_bytes < 1 or self.max_key_bytes < 1 or self.max_batch < 1:
            raise ValueError("alignment and limits must be >= 1")


def parse(argv: list[str] | None = None) -> MasterConfig:
    d = MasterConfig()
    ap = new_parser("splitserve kvstore-master", "Run the KV store metadata master.")
    ap.add_argument("--host", default=env_str("PD_HOST", d.host), help="address the gRPC server listens on")
    ap.add_argument("--port", type=int, default=env_int("PD_KVSTORE_MASTER_PORT", d.port), help="gRPC port (0: any free port)")
    ap.add_argument("--replicas", type=int, default=env_int("PD_KVSTORE_REPLICAS", d.default_replicas),
                    help="default copies per object, on distinct storage nodes")
    ap.add_argument("--lease-s", type=float, default=env_float("PD_KVSTORE_LEASE_S", d.lease_s),
                    help="seconds a read lease blocks removal and eviction of the objects read")
    ap.add_argument("--put-timeout-s", type=float, default=env_float("PD_KVSTORE_PUT_TIMEOUT_S", d.put_timeout_s),
                    help="seconds after which an unfinished write is a zombie: its space is reclaimed")
    ap.add_argument("--heartbeat-interval-s", type=float, default=env_float("PD_KVSTORE_HEARTBEAT_INTERVAL_S", d.heartbeat_interval_s),
                    help="seconds between storage node heartbeats")
    ap.add_argument("--heartbeat-timeout-s", type=float, default=env_float("PD_KVSTORE_HEARTBEAT_TIMEOUT_S", d.heartbeat_timeout_s),
                    help="seconds of silence after which a storage node is dead and its replicas are dropped")
    ap.add_argument("--evict-high", type=float, default=env_float("PD_KVSTORE_EVICT_HIGH", d.evict_high),
                    help="eviction starts when a write would fill a segment above this fraction")
    ap.add_argument("--evict-low", type=float, default=env_float("PD_KVSTORE_EVICT_LOW", d.evict_low),
                    help="eviction frees least recently used objects down to this fraction")
    ap.add_argument("--metrics-port", type=int, default=env_int("PD_METRICS_PORT", 0), help="HTTP /metrics port; 0 = any free, -1 = off")
    add_tls_args(ap)
    add_keepalive_args(ap)
    a = ap.parse_args(argv)
    return MasterConfig(
        host=a.host, port=a.port, default_replicas=a.replicas, lease_s=a.lease_s, put_timeout_s=a.put_timeout_s,
        heartbeat_interval_s=a.heartbeat_interval_s, heartbeat_timeout_s=a.heartbeat_timeout_s,
        evict_high=a.evict_high, evict_low=a.evict_low, metrics_port=a.metrics_port, tls=tls_config(a),
        keepalive=keepalive_config(a),
    )

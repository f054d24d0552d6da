"""Prefill worker settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.config_checks import check_port
from splitserve.env import env_float, env_int, env_str
from splitserve.errors import InvalidRequest
from splitserve.services.worker_config import WorkerConfig, add_worker_args, worker_fields
from splitserve.transfer.common import parse_endpoint


@dataclass(frozen=True, slots=True)
class PrefillConfig(WorkerConfig):
    """A :class:`WorkerConfig` plus where decode workers pull KV from, and how long it is held for them."""

    port: int = 50061
    data_host: str = "127.0.0.1"  # address advertised for KV pulls
    data_port: int = 0  # 0 = any free port
    data_advertise: str | None = None  # "host:port" put in KV handles instead of data_host:<bound port> (NAT)
    kv_lease_s: float = 30.0  # KV blocks are freed if no decode worker pulls them within this time

    def __post_init__(self) -> None:
        WorkerConfig.__post_init__(self)  # (slots dataclass: no zero-argument super())
        check_port("--data-port", self.data_port)
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if self.data_advertise:
            try:
                parse_endpoint(self.data_advertise)
            except InvalidRequest as exc:
                raise ValueError(f"data_advertise: {exc}") from None


def parse(argv: list[str] | None = None) -> PrefillConfig:
    ap = new_parser("splitserve prefill", "Run a prefill worker.")
    add_worker_args(ap, port_env="PD_PREFILL_PORT", port=50061, prefix_caching=False)  # prefixes: the KV store
    ap.add_argument("--data-host", default=env_str("PD_DATA_HOST", "127.0.0.1"),
                    help="address of the UCX endpoint decode workers pull KV from")
    ap.add_argument("--data-port", type=int, default=env_int("PD_DATA_PORT", 0), help="port of that UCX endpoint (0: any free port)")
    ap.add_argument("--data-advertise", default=env_str("PD_DATA_ADVERTISE"),
                    help="host:port decode workers pull KV from, when it differs from the listening address (NAT)")
    ap.add_argument("--kv-lease-s", type=float, default=env_float("PD_KV_LEASE_S", 30.0),
                    help="seconds a prompt's KV blocks are held for a decode worker to pull; then they are freed")
    a = ap.parse_args(argv)
    return PrefillConfig(**worker_fields(a), data_host=a.data_host, data_port=a.data_port,
                         data_advertise=a.data_advertise, kv_lease_s=a.kv_lease_s)

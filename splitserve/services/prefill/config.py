"""Prefill worker settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.services.kv_transfer_config import add_kv_source_args, check_kv_source, kv_source_fields
from splitserve.services.worker_config import WorkerConfig, add_worker_args, worker_fields


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
        check_kv_source(self)


def parse(argv: list[str] | None = None) -> PrefillConfig:
    ap = new_parser("splitserve prefill", "Run a prefill worker.")
    add_worker_args(ap, port_env="PD_PREFILL_PORT", port=50061, prefix_caching=False)  # prefixes: the KV store
    add_kv_source_args(ap)
    a = ap.parse_args(argv)
    return PrefillConfig(**worker_fields(a), **kv_source_fields(a))

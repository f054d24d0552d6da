"""Settings of a worker whose role can change (`splitserve worker`): a prefill worker's and a decode worker's, plus
its role at start. CLI flags with PD_* environment defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.config_checks import check_port
from splitserve.env import env_bool, env_choice, env_float, env_int, env_str
from splitserve.errors import InvalidRequest
from splitserve.services.decode.config import KV_TRANSFER_FAILURES
from splitserve.services.worker.roles import ROLES, check_role
from splitserve.services.worker_config import WorkerConfig, add_worker_args, worker_fields
from splitserve.transfer.common import parse_endpoint


@dataclass(frozen=True, slots=True)
class RoleWorkerConfig(WorkerConfig):
    """A :class:`WorkerConfig` plus ``role`` (at start: "prefill", "decode" or "both"; SetRole changes it), the
    prefill side's KV endpoint and lease (as :class:`~splitserve.services.prefill.config.PrefillConfig`) and the
    decode side's KV pull settings (as :class:`~splitserve.services.decode.config.DecodeConfig`).

    Raises:
        ValueError: an unknown role, or a value the prefill or decode worker would refuse (the message names it).
    """

    port: int = 50081
    role: str = "both"
    role_switch_grace_s: float = 3.0  # after a switch the role left is still admitted this long (routers' poll lag)
    data_host: str = "127.0.0.1"  # address advertised for KV pulls
    data_port: int = 0  # 0 = any free port
    data_advertise: str | None = None  # "host:port" put in KV handles instead of data_host:<bound port> (NAT)
    kv_lease_s: float = 30.0  # KV blocks are freed if no decode worker pulls them within this time
    kv_transfer_timeout_s: float = 10.0  # a KV pull that takes longer fails (then kv_transfer_failure applies)
    kv_transfer_failure: str = "fallback"  # "fallback": recompute the prompt here; "error": fail the request
    kv_checksum: bool = False  # verify an xxh3-64 checksum of every pulled transfer
    kv_push_layer_groups: int = 0  # push: layer groups sent as soon as computed (0: one per layer; 1: whole KV at the end)

    def __post_init__(self) -> None:
        WorkerConfig.__post_init__(self)  # (slots dataclass: no zero-argument super())
        check_role(self.role)
        if not self.role_switch_grace_s >= 0:
            raise ValueError(f"--role-switch-grace-s must be >= 0, got {self.role_switch_grace_s}")
        check_port("--data-port", self.data_port)
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if self.kv_transfer_failure not in KV_TRANSFER_FAILURES:
            raise ValueError(f"kv_transfer_failure must be 'fallback' or 'error', got {self.kv_transfer_failure!r}")
        if self.kv_push_layer_groups < 0:
            raise ValueError(f"kv_push_layer_groups must be >= 0 (0: one per layer), got {self.kv_push_layer_groups}")
        if self.data_advertise:
            try:
                parse_endpoint(self.data_advertise)
            except InvalidRequest as exc:
                raise ValueError(f"data_advertise: {exc}") from None


def parse(argv: list[str] | None = None) -> RoleWorkerConfig:
    ap = new_parser("splitserve worker", "Run a worker that serves prefill, decode or both, and can switch role in place "
                                         "(pd.v1.RoleService/SetRole; the router's planner flips it).")
    ap.add_argument("--role", choices=ROLES, default=env_choice("PD_WORKER_ROLE", ROLES, "both"),
                    help="the work it takes at start (PD_WORKER_ROLE)")
    ap.add_argument("--role-switch-grace-s", type=float, default=env_float("PD_ROLE_SWITCH_GRACE_S", 3.0),
                    help="after a role switch, calls of the role left are still admitted for this many seconds: routers "
                         "that have not polled since still send them (keep it above the routers' --poll-interval-s)")
    add_worker_args(ap, port_env="PD_WORKER_PORT", port=50081)
    ap.add_argument("--data-host", default=env_str("PD_DATA_HOST", "127.0.0.1"),
                    help="address of the UCX endpoint decode workers pull KV from")
    ap.add_argument("--data-port", type=int, default=env_int("PD_DATA_PORT", 0), help="port of that UCX endpoint (0: any free port)")
    ap.add_argument("--data-advertise", default=env_str("PD_DATA_ADVERTISE"),
                    help="host:port decode workers pull KV from, when it differs from the listening address (NAT)")
    ap.add_argument("--kv-lease-s", type=float, default=env_float("PD_KV_LEASE_S", 30.0),
                    help="seconds a prompt's KV blocks are held for a decode worker to pull; then they are freed")
    ap.add_argument("--kv-transfer-timeout-s", type=float, default=env_float("PD_KV_TRANSFER_TIMEOUT_S", 10.0),
                    help="seconds a KV pull may take; a slower one fails (then --kv-transfer-failure applies)")
    ap.add_argument("--kv-transfer-failure", choices=KV_TRANSFER_FAILURES,
                    default=env_choice("PD_KV_TRANSFER_FAILURE", KV_TRANSFER_FAILURES, "fallback"),
                    help="when a KV pull fails: recompute the prompt here (fallback) or fail the request (error)")
    ap.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction, default=env_bool("PD_KV_CHECKSUM"),
                    help="verify an xxh3-64 checksum of every pulled KV transfer (mismatch: as a failed pull)")
    ap.add_argument("--kv-push-layer-groups", type=int, default=env_int("PD_KV_PUSH_LAYER_GROUPS", 0),
                    help="push mode, as decode: layer groups sent as each is computed (0: one per layer; 1: the whole KV at the end)")
    a = ap.parse_args(argv)
    return RoleWorkerConfig(**worker_fields(a), role=a.role, role_switch_grace_s=a.role_switch_grace_s, data_host=a.data_host, data_port=a.data_port,
                            data_advertise=a.data_advertise, kv_lease_s=a.kv_lease_s,
                            kv_transfer_timeout_s=a.kv_transfer_timeout_s, kv_transfer_failure=a.kv_transfer_failure,
                            kv_checksum=a.kv_checksum, kv_push_layer_groups=a.kv_push_layer_groups)

"""Settings of a worker whose role can change (`splitserve worker`): a prefill worker's and a decode worker's, plus
its role at start. CLI flags with PD_* environment defaults."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.config_checks import check_push_layer_groups
from splitserve.env import env_choice, env_float, env_int
from splitserve.services.kv_transfer_config import (add_kv_pull_args, add_kv_source_args, check_kv_pull, check_kv_source,
                                                    kv_pull_fields, kv_source_fields)
from splitserve.services.worker.roles import ROLES, check_role
from splitserve.services.worker_config import WorkerConfig, add_worker_args, worker_fields


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
        check_kv_source(self)
        check_kv_pull(self)
        if self.kv_push_layer_groups < 0:
            raise ValueError(f"kv_push_layer_groups must be >= 0 (0: one per layer), got {self.kv_push_layer_groups}")


def parse(argv: list[str] | None = None) -> RoleWorkerConfig:
    ap = new_parser("splitserve worker", "Run a worker that serves prefill, decode or both, and can switch role in place "
                                         "(pd.v1.RoleService/SetRole; the router's planner flips it).")
    ap.add_argument("--role", choices=ROLES, default=env_choice("PD_WORKER_ROLE", ROLES, "both"),
                    help="the work it takes at start (PD_WORKER_ROLE)")
    ap.add_argument("--role-switch-grace-s", type=float, default=env_float("PD_ROLE_SWITCH_GRACE_S", 3.0),
                    help="after a role switch, calls of the role left are still admitted for this many seconds: routers "
                         "that have not polled since still send them (keep it above the routers' --poll-interval-s)")
    add_worker_args(ap, port_env="PD_WORKER_PORT", port=50081)
    add_kv_source_args(ap)
    add_kv_pull_args(ap)
    ap.add_argument("--kv-push-layer-groups", type=int, default=env_int("PD_KV_PUSH_LAYER_GROUPS", 0),
                    help="push mode, as decode: layer groups sent as each is computed (0: one per layer; 1: the whole KV at the end)")
    a = ap.parse_args(argv)
    check_push_layer_groups(a.model, a.kv_push_layer_groups)
    return RoleWorkerConfig(**worker_fields(a), role=a.role, role_switch_grace_s=a.role_switch_grace_s,
                            **kv_source_fields(a), **kv_pull_fields(a), kv_push_layer_groups=a.kv_push_layer_groups)

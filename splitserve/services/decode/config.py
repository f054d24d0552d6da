"""Decode worker settings: CLI flags with PD_* environment defaults."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.cli_help import new_parser
from splitserve.config_checks import check_push_layer_groups
from splitserve.env import env_float, env_int
from splitserve.services.kv_transfer_config import add_kv_pull_args, check_kv_pull, kv_pull_fields
from splitserve.services.worker_config import WorkerConfig, add_worker_args, worker_fields


@dataclass(frozen=True, slots=True)
class DecodeConfig(WorkerConfig):
    """A :class:`WorkerConfig` plus how KV pulls are bounded and checked, and what a failed one does."""

    port: int = 50071
    kv_transfer_timeout_s: float = 10.0  # a KV pull that takes longer fails (then kv_transfer_failure applies)
    kv_transfer_failure: str = "fallback"  # "fallback": recompute the prompt here; "error": fail the request
    kv_checksum: bool = False  # verify an xxh3-64 checksum of every pulled transfer
    kv_push_timeout_s: float = 60.0  # push: how long a subscription waits for the prefill (compute + KV) at most
    kv_push_layer_groups: int = 0  # push: layer groups sent as soon as computed (0: one per layer; 1: whole KV at the end)

    def __post_init__(self) -> None:
        WorkerConfig.__post_init__(self)  # (slots dataclass: no zero-argument super())
        check_kv_pull(self)
        if self.kv_push_timeout_s <= 0 or self.kv_push_layer_groups < 0:
            raise ValueError("kv_push_timeout_s must be > 0 and kv_push_layer_groups >= 0")


def parse(argv: list[str] | None = None) -> DecodeConfig:
    ap = new_parser("splitserve decode", "Run a decode worker.")
    add_worker_args(ap, port_env="PD_DECODE_PORT", port=50071)
    add_kv_pull_args(ap)
    ap.add_argument("--kv-push-timeout-s", type=float, default=env_float("PD_KV_PUSH_TIMEOUT_S", 60.0),
                    help="push mode: seconds a decode worker waits for the prefill worker's push (compute included)")
    ap.add_argument("--kv-push-layer-groups", type=int, default=env_int("PD_KV_PUSH_LAYER_GROUPS", 0),
                    help="push mode: layer groups sent as each is computed (0: one per layer; 1: the whole KV at the end)")
    a = ap.parse_args(argv)
    check_push_layer_groups(a.model, a.kv_push_layer_groups)
    return DecodeConfig(**worker_fields(a), **kv_pull_fields(a), kv_push_timeout_s=a.kv_push_timeout_s,
                        kv_push_layer_groups=a.kv_push_layer_groups)

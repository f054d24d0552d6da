"""The KV transfer flags the worker commands share: :func:`add_kv_source_args` (where decode workers pull a prefill
worker's KV from, and how long it is held: ``splitserve prefill`` and ``splitserve worker``) and
:func:`add_kv_pull_args` (how a decode worker's KV pulls are bounded and checked: ``splitserve decode`` and
``splitserve worker``). Each comes with the config's keyword arguments from the parsed flags (``*_fields``) and the
checks its ``__post_init__`` runs (``check_*``)."""

from __future__ import annotations

import argparse
from typing import Any

from splitserve.config_checks import check_port
from splitserve.env import env_bool, env_choice, env_float, env_int, env_str
from splitserve.errors import InvalidRequest
from splitserve.transfer.common import parse_endpoint

KV_TRANSFER_FAILURES = ("fallback", "error")


def add_kv_source_args(ap: argparse.ArgumentParser) -> None:
    """``--data-host``, ``--data-port``, ``--data-advertise`` and ``--kv-lease-s`` (PD_* environment defaults)."""
    ap.add_argument("--data-host", default=env_str("PD_DATA_HOST", "127.0.0.1"),
                    help="address of the UCX endpoint decode workers pull KV from")
    ap.add_argument("--data-port", type=int, default=env_int("PD_DATA_PORT", 0), help="port of that UCX endpoint (0: any free port)")
    ap.add_argument("--data-advertise", default=env_str("PD_DATA_ADVERTISE"),
                    help="host:port decode workers pull KV from, when it differs from the listening address (NAT)")
    ap.add_argument("--kv-lease-s", type=float, default=env_float("PD_KV_LEASE_S", 30.0),
                    help="seconds a prompt's KV blocks are held for a decode worker to pull; then they are freed")


def kv_source_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The config keyword arguments from flags that :func:`add_kv_source_args` added."""
    return dict(data_host=a.data_host, data_port=a.data_port, data_advertise=a.data_advertise, kv_lease_s=a.kv_lease_s)


def check_kv_source(c) -> None:
    """Check a config's ``data_port``, ``kv_lease_s`` (seconds, > 0) and ``data_advertise`` ("host:port" or None).

    Raises:
        ValueError: naming the first bad value.
    """
    check_port("--data-port", c.data_port)
    if c.kv_lease_s <= 0:
        raise ValueError(f"kv_lease_s must be > 0, got {c.kv_lease_s}")
    if c.data_advertise:
        try:
            parse_endpoint(c.data_advertise)
        except InvalidRequest as exc:
            raise ValueError(f"data_advertise: {exc}") from None


def add_kv_pull_args(ap: argparse.ArgumentParser) -> None:
    """``--kv-transfer-timeout-s``, ``--kv-transfer-failure`` and ``--[no-]kv-checksum`` (PD_* environment defaults)."""
    ap.add_argument("--kv-transfer-timeout-s", type=float, default=env_float("PD_KV_TRANSFER_TIMEOUT_S", 10.0),
                    help="seconds a KV pull may take; a slower one fails (then --kv-transfer-failure applies)")
    ap.add_argument("--kv-transfer-failure", choices=KV_TRANSFER_FAILURES,
                    default=env_choice("PD_KV_TRANSFER_FAILURE", KV_TRANSFER_FAILURES, "fallback"),
                    help="when a KV pull fails: recompute the prompt here (fallback) or fail the request (error)")
    ap.add_argument("--kv-checksum", action=argparse.BooleanOptionalAction, default=env_bool("PD_KV_CHECKSUM"),
                    help="verify an xxh3-64 checksum of every pulled KV transfer (mismatch: as a failed pull)")


def kv_pull_fields(a: argparse.Namespace) -> dict[str, Any]:
    """The config keyword arguments from flags that :func:`add_kv_pull_args` added."""
    return dict(kv_transfer_timeout_s=a.kv_transfer_timeout_s, kv_transfer_failure=a.kv_transfer_failure,
                kv_checksum=a.kv_checksum)


def check_kv_pull(c) -> None:
    """Check a config's ``kv_transfer_timeout_s`` (seconds, > 0) and ``kv_transfer_failure`` (one of
    :data:`KV_TRANSFER_FAILURES`).

    Raises:
        ValueError: naming the first bad value.
    """
    if c.kv_transfer_timeout_s <= 0:
        raise ValueError(f"kv_transfer_timeout_s must be > 0, got {c.kv_transfer_timeout_s}")
    if c.kv_transfer_failure not in KV_TRANSFER_FAILURES:
        raise ValueError(f"kv_transfer_failure must be 'fallback' or 'error', got {c.kv_transfer_failure!r}")

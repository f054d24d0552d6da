"""gRPC keepalive on every hop: a hung peer (stopped, frozen, partitioned) is detected, never waited on.

A TCP connection to a process that is SIGSTOPped or frozen stays open (the kernel still ACKs), so a call to it
would wait forever. HTTP/2 PINGs need the peer *process* to answer, so every channel and server pings its
peer every ``time_s`` and closes the connection when no answer comes within ``timeout_s``: the calls on it
fail with UNAVAILABLE ("ping timeout"), the router fails over or ends the stream with an error, and a
worker's handlers for a hung client are cancelled (their KV blocks freed). Connecting to a hung peer (TCP
accepted, HTTP/2 handshake never answered) fails after the same ``time_s + timeout_s``.

The pings are answered by gRPC's core threads, not by Python code: a process whose event loop is stuck
still answers them. The router's decode stall timeout and health polls cover that case.

Both sides must agree, or a server answers frequent pings with GOAWAY ``too_many_pings``: servers accept
pings down to every :data:`MIN_PING_INTERVAL_MS`, with or without calls, and ``time_s`` may not be lower.

Settings: ``--grpc-keepalive-time-s`` / ``PD_GRPC_KEEPALIVE_TIME_S`` (10) and ``--grpc-keepalive-timeout-s`` /
``PD_GRPC_KEEPALIVE_TIMEOUT_S`` (5) on every command; a process applies them with :func:`configure` before
it opens channels or servers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping

from splitserve.env import env_float

#: servers accept a ping this often (ms) with or without calls; half the smallest allowed keepalive time,
#: so timer jitter never counts as a "ping strike"
MIN_PING_INTERVAL_MS = 500
MIN_TIME_S = 1.0


@dataclass(frozen=True, slots=True)
class KeepaliveConfig:
    """``time_s``: seconds between PINGs on a connection (>= 1); ``timeout_s``: seconds to wait for the answer
    (> 0). A hung peer is detected within ``time_s + timeout_s``. Raises ValueError out of range."""

    time_s: float = 10.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.time_s >= MIN_TIME_S:
            raise ValueError(f"gRPC keepalive time must be >= {MIN_TIME_S:g} s, got {self.time_s}")
        if not self.timeout_s > 0:
            raise ValueError(f"gRPC keepalive timeout must be > 0 s, got {self.timeout_s}")

    @property
    def detect_s(self) -> float:
        """Upper bound of the time to detect a hung peer."""
        return self.time_s + self.timeout_s

    def _common(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            # the timeout of any ping in flight; gRPC's default (60 s) wins over keepalive_timeout_ms when the
            # keepalive ping joins one that is already out (e.g. a BDP probe)
            ("grpc.http2.ping_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),  # idle connections too: a new call never meets a dead one
            ("grpc.http2.max_pings_without_data", 0),  # a server-streaming client sends no data: keep pinging
        ]

    def channel_options(self) -> list[tuple[str, int]]:
        # gRPC's minimum connect timeout is the misnamed min_reconnect_backoff (default 20 s): a hung peer that
        # accepts TCP but never answers the HTTP/2 handshake fails as fast as one found hung on a live connection
        return [*self._common(), ("grpc.min_reconnect_backoff_ms", int(self.detect_s * 1000))]

    def server_options(self) -> list[tuple[str, int]]:
        return [
            *self._common(),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),  # accept clients' pings
        ]


def keepalive_from_env(environ: Mapping[str, str] | None = None) -> KeepaliveConfig:
    """The configuration ``PD_GRPC_KEEPALIVE_TIME_S`` / ``PD_GRPC_KEEPALIVE_TIMEOUT_S`` describe (defaults 10, 5)."""
    return KeepaliveConfig(env_float("PD_GRPC_KEEPALIVE_TIME_S", 10.0, environ),
                           env_float("PD_GRPC_KEEPALIVE_TIMEOUT_S", 5.0, environ))


_current: KeepaliveConfig | None = None


def current() -> KeepaliveConfig:
    """What this process's channels and servers use: the last :func:`configure`, else the environment."""
    return _current if _current is not None else keepalive_from_env()


def configure(config: KeepaliveConfig | None) -> None:
    """Apply ``config`` to every channel and server this process creates from now on (None: the environment's)."""
    global _current
    _current = config


def add_keepalive_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("gRPC keepalive (hung peers)")
    g.add_argument("--grpc-keepalive-time-s", type=float, default=env_float("PD_GRPC_KEEPALIVE_TIME_S", 10.0),
                   help="seconds between HTTP/2 PINGs on every gRPC connection (>= 1)")
    g.add_argument("--grpc-keepalive-timeout-s", type=float, default=env_float("PD_GRPC_KEEPALIVE_TIMEOUT_S", 5.0),
                   help="a peer that does not answer a PING within this many seconds is treated as gone")


def keepalive_config(args: argparse.Namespace) -> KeepaliveConfig:
    return KeepaliveConfig(args.grpc_keepalive_time_s, args.grpc_keepalive_timeout_s)

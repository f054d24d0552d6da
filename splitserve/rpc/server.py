"""Shared gRPC plumbing for every service: aio server, health service, limits, TLS, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.env import env_int
from splitserve.rpc import keepalive
from splitserve.rpc.interceptors import ApiKeyInterceptor, StrictDecodeInterceptor
from splitserve.rpc.shutdown import Drain, DrainInterceptor
from splitserve.rpc.tls import TlsConfig
from splitserve.telemetry.interceptors import client_interceptors, server_interceptors

logger = logging.getLogger(__name__)


def max_message_bytes() -> int:
    """Largest gRPC message any server or channel accepts or sends (``PD_GRPC_MAX_MESSAGE_MB``, default 16).

    pd.v1 carries control data only (KV bytes go over UCX). The largest legitimate message is a prompt of
    the longest context, as token ids (<= 5 bytes each) or text (a few bytes per token): 16 MiB covers a
    1M-token context. Anything larger is refused with RESOURCE_EXHAUSTED before it is parsed."""
    mb = env_int("PD_GRPC_MAX_MESSAGE_MB", 16)
    if mb < 1:
        raise ValueError(f"PD_GRPC_MAX_MESSAGE_MB must be >= 1, got {mb}")
    return mb * 2**20


def _limits() -> list[tuple[str, int]]:
    n = max_message_bytes()
    return [
        ("grpc.max_send_message_length", n),
        ("grpc.max_receive_message_length", n),
        ("grpc.max_metadata_size", 16 * 1024),  # auth + trace headers; far below any abuse
    ]


#: the message and metadata limits every server and channel uses (as of import; see max_message_bytes)
GRPC_OPTIONS = _limits()


#: a connection that has not completed the HTTP/2 handshake by then is closed (half-open or idle sockets), s
HANDSHAKE_TIMEOUT_S = 10.0
#: a client connection with no call for this long is closed with GOAWAY (the client reconnects on its next call), s
MAX_CONNECTION_IDLE_S = 600.0


def server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
        ("grpc.max_connection_idle_ms", int(MAX_CONNECTION_IDLE_S * 1000)),
        *_limits(),
        # keepalive: clients of hung or vanished peers are detected and their handlers cancelled (splitserve.rpc.keepalive)
        *keepalive.current().server_options(),
        # grpcio sets SO_REUSEPORT by default: a second server on a used port would then come up silently and
        # take part of the first one's connections. One server per port: the second bind fails (BindError).
        ("grpc.so_reuseport", 0),
    ]


def channel_options() -> list[tuple[str, int]]:
    return [
        *_limits(),
        *keepalive.current().channel_options(),  # a hung peer fails the calls on it (splitserve.rpc.keepalive)
        # A restarted worker is used again within seconds (gRPC's default backoff grows to 2 minutes).
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


def create_server(
    *, api_key: str | None = None, protected_services: Sequence[str] = (), drain: Drain | None = None,
    work_methods: Sequence[str] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An aio server with a health service, message size limits, keepalive, requests that fail to parse refused
    with INVALID_ARGUMENT, and (with ``api_key``) ``authorization: Bearer <key>`` required on the methods
    of ``protected_services`` (full names, e.g. ``pd.v1.RouterService``). With ``drain``, calls of
    ``work_methods`` (full paths, e.g. ``/pd.v1.DecodeService/Decode``) are counted and refused once it drains
    (graceful shutdown: :mod:`splitserve.rpc.shutdown`)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [*server_interceptors()]  # tracing, if set up
    if drain is not None:
        interceptors.append(DrainInterceptor(drain, work_methods))
    if api_key:
        interceptors.append(ApiKeyInterceptor(api_key, protected_services))
    interceptors.append(StrictDecodeInterceptor())
    server = grpc.aio.server(options=server_options(), interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


class BindError(OSError):
    """A server could not listen on its address (port in use, address not local); the CLI prints it as one line."""


def bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None = None) -> int:
    """Bind on host:port (0 = any free port), with TLS when ``tls`` is enabled; returns the bound port.

    Raises:
        BindError: the address cannot be bound (grpcio raises RuntimeError or returns 0).
    """
    address = f"{host}:{port}"
    try:
        if tls is not None and tls.enabled:
            bound = server.add_secure_port(address, tls.server_credentials())
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise BindError(f"cannot listen on {address} (gRPC): the port is in use or the address is not local")
    return bound


async def set_serving(health_servicer: health.aio.HealthServicer, services: list[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *services]:
        await health_servicer.set(name, status)


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (for a graceful shutdown)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """An aio channel to ``address`` with the shared limits; TLS (and a client certificate) when enabled."""
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(
            address, tls.channel_credentials(), options=[*channel_options(), *tls.channel_options()],
            interceptors=client_interceptors(),
        )
    return grpc.aio.insecure_channel(address, options=channel_options(), interceptors=client_interceptors())


def insecure_channel(address: str) -> grpc.aio.Channel:
    return channel(address)


def sync_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel (health polling in the launcher)."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), options=[*channel_options(), *tls.channel_options()])
    return grpc.insecure_channel(address, options=channel_options())

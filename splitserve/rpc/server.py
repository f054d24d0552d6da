"""Shared gRPC server plumbing for every service: aio server, health service, graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.telemetry.interceptors import client_interceptors, server_interceptors

logger = logging.getLogger(__name__)

# Control messages are small, but prompts of long contexts are not: allow 64 MiB of token ids.
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 2**20),
    ("grpc.max_receive_message_length", 64 * 2**20),
]


def create_server() -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=server_interceptors())  # tracing, if set up
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind insecure on host:port (0 = any free port); returns the bound port."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
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


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS, interceptors=client_interceptors())

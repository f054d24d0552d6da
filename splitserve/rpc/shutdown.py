"""Graceful shutdown of a service process: drain, then stop.

On the first SIGTERM or SIGINT (:func:`serve_until_signalled`):

1. the process starts *draining*: its health service says NOT_SERVING for every service at once (the
   router's registry takes it out of rotation on its next poll), and new work calls (:class:`DrainInterceptor`:
   ``Prefill``, ``Decode``, ``Generate``; HTTP requests through
   :class:`splitserve.frontend.draining.DrainMiddleware`) are refused with UNAVAILABLE / HTTP 503, which
   the router answers by failing over to another worker before the first token. Health checks, stats,
   ``GetKVLayout`` and ``ReleaseKV`` keep working.
2. calls already running finish: the process waits until no work call is in flight and ``busy()`` is
   false (e.g. a prefill worker's KV still held for a decode worker to pull), for at most the grace period
   (``--shutdown-grace-s`` / ``PD_SHUTDOWN_GRACE_S``, 30 s; 0 = stop at once). A second signal cuts it short.
3. the gRPC server stops (calls still running after the grace period are cancelled) and the caller closes
   the rest in order; the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from typing import Callable, Collection

import grpc
from grpc_health.v1 import health, health_pb2

from splitserve.env import env_float
from splitserve.rpc.interceptors import _deny

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
_POLL_S = 0.05
DRAINING_MESSAGE = "shutting down (draining); send new requests to another worker"


class Drain:
    """Draining state of one process, shared by its gRPC and HTTP front doors.

    ``active``: work calls and HTTP requests in flight (counted by :class:`DrainInterceptor` and the HTTP
    middleware); ``draining``: set once by :meth:`begin`, after which new work is refused.
    """

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self.expired = asyncio.Event()  # set when the grace period ran out: streams still open end now

    def begin(self) -> None:
        self.draining = True

    def enter(self) -> bool:
        """Count one new call in; False (and nothing counted) while draining: refuse it."""
        if self.draining:
            return False
        self.active += 1
        return True

    def exit(self) -> None:
        self.active -= 1

    async def wait_idle(self, grace_s: float, busy: Callable[[], bool] | None = None,
                        hurry: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> bool:
        """Wait until nothing is in flight and ``busy()`` is false, at most ``grace_s`` seconds or until ``hurry``
        is set. Returns True when idle."""
        end = clock() + grace_s
        while True:
            if self.active <= 0 and not (busy is not None and busy()):
                return True
            if clock() >= end or (hurry is not None and hurry.is_set()):
                return False
            await asyncio.sleep(min(_POLL_S, max(end - clock(), 0.0)))


def _counted(handler: grpc.RpcMethodHandler, drain: Drain) -> grpc.RpcMethodHandler:
    """``handler``, refusing (UNAVAILABLE) once draining and counting itself in :attr:`Drain.active` while it runs."""
    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request, context):
            if not drain.enter():
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            try:
                return await inner_uu(request, context)
            finally:
                drain.exit()

        return grpc.unary_unary_rpc_method_handler(unary_unary, **kw)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request, context):
            if not drain.enter():
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            try:
                async for response in inner_us(request, context):
                    yield response
            finally:
                drain.exit()

        return grpc.unary_stream_rpc_method_handler(unary_stream, **kw)
    return handler  # client-streaming methods: none in pd.v1


class DrainInterceptor(grpc.aio.ServerInterceptor):
    """Counts the calls of ``methods`` (full paths, e.g. ``/pd.v1.DecodeService/Decode``) in ``drain`` and
    refuses new ones with UNAVAILABLE once it is draining; every other method is left alone."""

    def __init__(self, drain: Drain, methods: Collection[str]) -> None:
        self.drain = drain
        self.methods = frozenset(methods)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        if self.drain.draining:  # refused before it starts
            return _deny(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE, handler.unary_stream is not None)
        return _counted(handler, self.drain)


class ShutdownSignals:
    """SIGTERM/SIGINT of this process (``install=False``: none; call :meth:`signal` instead): ``first`` is set by
    the first one (drain), ``second`` by the next (hurry)."""

    def __init__(self, install: bool = True) -> None:
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        if install:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.signal)

    def signal(self) -> None:
        if self.first.is_set():
            self.second.set()
        self.first.set()


async def serve_until_signalled(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, services: list[str], drain: Drain, *,
    grace_s: float, name: str, busy: Callable[[], bool] | None = None, signals: ShutdownSignals | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain (see the module docstring) and stop ``server``.

    ``services``: full service names whose health goes NOT_SERVING (the overall status "" too);
    ``busy``: extra work to wait for besides the calls in flight; ``signals``: default this process's
    SIGTERM/SIGINT (tests pass their own). The caller closes everything else afterwards.
    """
    signals = signals or ShutdownSignals()
    await signals.first.wait()
    drain.begin()
    for service in ["", *services]:  # at once: no new work is routed here
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    logger.info("%s draining: %d call(s) in flight, grace %.1f s", name, drain.active, grace_s)
    t0 = time.monotonic()
    if await drain.wait_idle(grace_s, busy, hurry=signals.second):
        logger.info("%s drained in %.2f s; stopping", name, time.monotonic() - t0)
        await server.stop(grace=1.0)  # only health/stats calls can be left
    else:
        logger.warning("%s: %d call(s) still in flight after %.1f s; cancelling them", name, drain.active,
                       time.monotonic() - t0)
        drain.expired.set()  # HTTP streams end with an SSE error event + [DONE] (SSEResponse)
        await asyncio.sleep(0)
        await server.stop(grace=0)


def add_shutdown_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shutdown-grace-s", type=float, default=env_float("PD_SHUTDOWN_GRACE_S", DEFAULT_GRACE_S),
                    help="on SIGTERM/SIGINT, how long in-flight requests may take to finish (0: stop at once)")


def check_grace(grace_s: float) -> None:
    """Raises ValueError unless ``grace_s`` >= 0."""
    if not grace_s >= 0:
        raise ValueError(f"shutdown grace must be >= 0 s, got {grace_s}")
